"""Checks on models of the kinds third-party libraries train (``tests/library_models.py``): shared modules left as they
were found, inputs probed only where safe, float64 that is the training's function, graph batches, losses that
differentiate inside themselves, complex parameters and fake quantisation."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import library_models as lm

from gradwatch import CheckReport, check_gradients
from gradwatch.engine.function.batch import floating_tensors, leading_slice, opaque_parts, replace_tensors
from gradwatch.engine.function.complex_params import checked_gradient, checked_view
from gradwatch.engine.results.notes import NoteCode


def _slots(model: nn.Module) -> dict[tuple[int, str, str], tuple[int, torch.dtype]]:
    """Every parameter and buffer slot of the model, with the tensor it holds: what a check must leave as it found."""
    return {
        (id(module), kind, name): (id(t), t.dtype)
        for module in model.modules()
        for kind, table in (("param", module._parameters), ("buffer", module._buffers))
        for name, t in table.items()
        if t is not None
    }


def _noted(report: CheckReport, code: NoteCode) -> list[str]:
    return [note for note in report.notes if getattr(note, "code", None) == code]


def _train_step(model: nn.Module, batch: Any, loss_fn: Any) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    optimizer.zero_grad()
    loss_fn(model, batch).backward()
    optimizer.step()


def _case(prefix: str) -> lm.LibraryCase:
    return next(case for case in lm.CORRECT if case.name.startswith(prefix))


SHARED = list(lm.CORRECT[:4])


@pytest.mark.parametrize("case", SHARED, ids=[c.name for c in SHARED])
def test_a_check_leaves_shared_modules_as_it_found_them(case: lm.LibraryCase) -> None:
    torch.manual_seed(0)
    model = case.build()
    batch = case.batches()[0]
    before = _slots(model)
    report = check_gradients(model, batch, case.loss_fn)
    assert report.verdict == "ok"
    assert report.precision == "float64"
    assert _slots(model) == before
    _train_step(model, batch, case.loss_fn)  # crashed with float64 parameters left behind


class _Boom(BaseException):
    """Raised by the loss mid-check; not an Exception, so nothing in the check swallows it."""


def test_a_check_that_raised_leaves_the_model_as_it_found_it() -> None:
    torch.manual_seed(0)
    model = lm.SharedGate()
    batch = lm.regression_batches()[0]
    calls = []

    def loss_fn(m: nn.Module, b: Any) -> Tensor:
        calls.append(m.enc.weight.dtype)
        if len(calls) == 4:  # during the float64 probes
            raise _Boom
        return lm.mse(m, b)

    before = _slots(model)
    with pytest.raises(_Boom):
        check_gradients(model, batch, loss_fn)
    assert torch.float64 in calls
    assert _slots(model) == before
    _train_step(model, batch, lm.mse)


def test_a_parameter_held_outside_the_module_tree_is_probed_where_the_loss_sees_it() -> None:
    torch.manual_seed(0)
    model = _case("parameter held").build()
    before = _slots(model)
    report = check_gradients(model, lm.regression_batches()[0], lm.likelihood_loss)
    assert report.verdict == "ok"
    assert report.precision == "native"  # float64 copies would leave the likelihood object on the original
    assert any("outside the module tree" in note for note in _noted(report, NoteCode.NATIVE_PRECISION))
    assert all(p.reason != "flat" for p in report.probes if p.target == "log_noise")
    assert _slots(model) == before


def test_a_loss_refusing_a_target_that_requires_grad_is_checked_without_input_probes() -> None:
    torch.manual_seed(0)
    report = check_gradients(lm.Regressor(), lm.regression_batches()[0], lm.target_asserting_mse)
    assert report.verdict == "ok"
    assert report.probed_inputs == ()
    assert not any(p.kind == "input" for p in report.probes)
    assert any("AssertionError" in note for note in _noted(report, NoteCode.INPUT_PROBES_REFUSED))


def test_inputs_a_loss_detaches_are_not_probed_and_probed_inputs_are_named() -> None:
    torch.manual_seed(0)
    model = lm.Regressor()
    x, y = lm.regression_batches()[0]
    noise = torch.randn(8, 6)

    def loss_fn(m: nn.Module, b: Any) -> Tensor:
        inputs, target, extra = b
        return F.mse_loss(m(inputs + extra.detach()), target)

    report = check_gradients(model, (x, y, noise), loss_fn)
    assert report.verdict == "ok"
    assert report.probed_inputs == ("batch[0]", "batch[1]")
    assert any("batch[2]" in note for note in _noted(report, NoteCode.INPUTS_DETACHED))


def test_the_float64_path_promotes_a_causal_mask_built_in_forward() -> None:
    torch.manual_seed(0)
    model = lm.CausalTransformer()
    batches = lm.token_batches()
    for step in range(3):
        _train_step(model, batches[step], lm.lm_loss)
        report = check_gradients(model, batches[step], lm.lm_loss, step=step)
        assert report.verdict == "ok", report.probes
        assert report.precision == "float64"


class _Float64Only(torch.autograd.Function):
    """Forward moves along (w - anchor) by 5% only in float64 (value unchanged at the anchor); backward is the
    identity: in float64 another function, whose backward disagrees with its forward; in float32 the identity."""

    @staticmethod
    def forward(ctx: Any, w: Tensor, anchor: Tensor) -> Tensor:
        return w + 0.05 * (w - anchor) if w.dtype == torch.float64 else w.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _Float64Path(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 4))
        self.register_buffer("anchor", self.weight.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x @ _Float64Only.apply(self.weight, self.anchor))


def test_a_failure_only_the_float64_path_shows_is_not_reported() -> None:
    torch.manual_seed(0)
    model = _Float64Path()
    batch = (torch.randn(8, 6), torch.randn(8, 4))
    report = check_gradients(model, batch, lm.mse, input_probes=0)
    assert report.verdict != "fail", report.probes
    assert _noted(report, NoteCode.FLOAT64_UNREPRODUCED)


def test_graph_batches_are_traversed_promoted_and_probed() -> None:
    pytest.importorskip("torch_geometric")
    torch.manual_seed(0)
    data = lm.graph_batches()[0]
    assert list(floating_tensors(data)) == ["batch.x"]
    moved = replace_tensors(data, {"batch.x": data.x.double()})
    assert moved.x.dtype == torch.float64
    assert data.x.dtype == torch.float32
    assert moved.edge_index is data.edge_index
    assert moved.num_graphs == data.num_graphs
    graphs, extra = leading_slice((data, torch.randn(data.num_graphs, 2)), 1)  # a Batch is cut into its first graphs
    assert graphs.num_graphs == 1
    assert torch.equal(graphs.x, data.x[: int(data.ptr[1])])
    assert extra.shape == (1, 2)
    single = data.to_data_list()[0]  # a Data has no graphs to cut: its node tensors are not per-sample
    assert leading_slice((single, torch.randn(4, 2)), 1)[0] is single
    for probe_batch_size in (None, 1):
        report = check_gradients(lm.GCN(), data, lm.graph_loss, probe_batch_size=probe_batch_size)
        assert report.verdict == "ok"
        assert report.precision == "float64"
        assert report.probed_inputs == ("batch.x",)
        assert report.samples == (probe_batch_size or data.num_graphs)


def test_objects_gradwatch_cannot_look_into_are_named() -> None:
    class Holder:
        def __init__(self) -> None:
            self.features = torch.randn(3)

    batch = (torch.randn(8, 6), {"extra": Holder(), "phase": torch.randn(8, dtype=torch.cfloat)}, torch.randn(8, 1))
    assert opaque_parts(batch) == ["batch[1]['extra']"]
    report = check_gradients(lm.Regressor(), batch, lambda m, b: F.mse_loss(m(b[0]), b[2]))
    assert report.verdict == "ok"
    named = _noted(report, NoteCode.BATCH_OPAQUE)
    assert len(named) == 2
    assert "batch[1]['extra']" in named[0]
    assert "batch[1]['phase']" in named[1]


def test_a_complex_gradient_is_checked_as_the_real_derivative() -> None:
    z = torch.randn(5, dtype=torch.cfloat, requires_grad=True)
    c = torch.randn(5, dtype=torch.cfloat)
    (grad,) = torch.autograd.grad((z * c).real.sum() + z.abs().pow(2).sum(), z)
    view, real_grad = checked_view(z), checked_gradient(z, grad)
    v = torch.randn(5, 2)
    with torch.no_grad():
        h = 1e-3
        base = z.detach().clone()
        f = lambda w: ((w * c).real.sum() + w.abs().pow(2).sum()).double()  # noqa: E731
        numeric = (f(base + h * torch.view_as_complex(v)) - f(base - h * torch.view_as_complex(v))) / (2 * h)
    assert view.shape == (5, 2)
    assert view.dtype == torch.float32
    assert float((real_grad * v).sum()) == pytest.approx(float(numeric), rel=1e-3)


@pytest.mark.parametrize(
    "case",
    [_case("FNO"), _case("PINN"), _case("WGAN")],
    ids=["fno", "pinn", "wgan-gp"],
)
def test_complex_weights_and_double_backward_losses_are_checked(case: lm.LibraryCase) -> None:
    torch.manual_seed(0)
    report = check_gradients(case.build(), case.batches()[0], case.loss_fn)
    assert report.verdict == "ok", report.notes
    assert report.precision == "float64"
    if case.build is lm.FNO:
        assert any(p.target == "spectral.weight" for p in report.probes)


@pytest.mark.parametrize("case", lm.BUGGY, ids=["fno", "pinn", "wgan-gp"])
def test_planted_bugs_in_complex_weights_and_double_backward_losses_fail(case: lm.LibraryCase) -> None:
    torch.manual_seed(0)
    report = check_gradients(case.build(), case.batches()[0], case.loss_fn)
    assert report.verdict == "fail"
    assert any(p.target.startswith(case.bug) for p in report.failures if p.kind in ("tensor", "param"))


def test_fake_quantisation_is_checked_as_its_straight_through_gradient_sees_it() -> None:
    """The fake quantisers run as the identity during a recomputed check: every parameter is probed and concludes, in
    float64; the batch's inputs are not probed; the quantisers are as they were afterwards."""
    torch.manual_seed(0)
    model = lm.QATNet()
    batches = lm.regression_batches()
    for step in range(3):
        _train_step(model, batches[step], lm.mse)
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        report = check_gradients(model, batches[step], lm.mse, step=step)
        assert report.verdict == "ok", report
        assert not [p for p in report.probes if p.verdict != "ok"], report
        assert {"fc1.weight", "fc2.weight"} <= {p.target for p in report.probes}
        assert report.precision == "float64"
        assert report.probed_inputs == ()
        assert any("as the identity" in note for note in _noted(report, NoteCode.FAKE_QUANTISATION))
        assert "forward" not in vars(model.act_fq)
        assert "forward" not in vars(model.w_fq)
        for name, b in model.named_buffers():
            assert torch.equal(b, buffers[name]), name


def test_a_bug_in_a_quantisation_aware_model_fails() -> None:
    torch.manual_seed(0)
    model = lm.QATNet(bug=1.05)
    batch = lm.regression_batches()[0]
    lm.mse(model, batch)  # the observers see a batch first, as in training
    report = check_gradients(model, batch, lm.mse)
    assert report.verdict == "fail", report
    assert any(p.target == "fc1.weight" for p in report.failures if p.kind in ("tensor", "param"))


@pytest.mark.parametrize(("prefix", "operation"), [("MoE", "nonzero()"), ("coupling", "float()")], ids=["moe", "flow"])
def test_a_loss_vmap_refuses_is_known_from_the_reference_pass(prefix: str, operation: str) -> None:
    torch.manual_seed(0)
    case = _case(prefix)
    report = check_gradients(case.build(), case.batches()[0], case.loss_fn, probe_batch_size=2)
    assert report.verdict == "ok"
    assert report.vectorized is None  # no vectorised pass was tried, none failed
    assert any(operation in note for note in _noted(report, NoteCode.NOT_VECTORISABLE))


def test_a_vectorisable_graph_network_stays_vectorised() -> None:
    pytest.importorskip("torch_geometric")
    torch.manual_seed(0)
    report = check_gradients(lm.GCN(), lm.graph_batches()[0], lm.graph_loss, probe_batch_size=2)
    assert report.vectorized is True
