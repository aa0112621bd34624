"""The guarantees of a check hold for any loss: whatever it does to the model (parameters changed in place, hooks,
submodules, rebinding, ``requires_grad``) and to optimizers is undone; a loss that calls ``backward()`` itself, a model
on the meta device get errors in gradwatch's words; a loss that refuses displaced inputs costs the input probes only."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import ScaledLinearFunction, assert_bit_identical, snapshot
from torch import Tensor, nn
from torch.nn.utils import parametrize

from gradwatch import check_gradients
from gradwatch.engine.function import copies
from gradwatch.engine.function.backward import LossCallsBackwardError
from gradwatch.engine.results.report import UnrestoredStateWarning


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


BATCH = (torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), torch.randn(6, 3))


def mse(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def _structure(model: nn.Module) -> list[Any]:
    """What a check must leave as it found it besides values: classes, submodules, parameters, hooks."""
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    modules = [
        (name, type(m), [id(c) for c in m.children()], {k: id(p) for k, p in m._parameters.items()}, *counts)
        for name, m in model.named_modules()
        for counts in [[len(getattr(m, h)) for h in hooks]]
    ]
    return [*modules, *[(n, p.requires_grad, len(p._backward_hooks or {})) for n, p in model.named_parameters()]]


def _global_hooks() -> int:
    return len(nn.modules.module._global_forward_hooks)


def _checked(loss: Callable[[nn.Module, Any], Tensor], **options: Any) -> tuple[Any, Net]:
    """The report of a check of ``loss`` on a fresh net with ``.grad`` set, asserting nothing observable changed."""
    model = Net()
    mse(model, BATCH).backward()  # the training's own .grad, which must survive
    before, structure, hooks = snapshot(model), _structure(model), _global_hooks()
    report = check_gradients(model, BATCH, loss, **options)
    assert_bit_identical(before, snapshot(model))
    assert _structure(model) == structure
    assert _global_hooks() == hooks
    return report, model


def _scaled(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    with torch.no_grad():
        model.fc1.weight.mul_(1.001)  # weight normalisation by hand, a projection step
    return mse(model, batch)


def _clamped(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    model.fc1.weight.data.clamp_(-0.2, 0.2)  # WGAN's weight clipping: invisible to version counters
    return mse(model, batch)


def _normalised_after(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    loss = mse(model, batch)
    with torch.no_grad():
        model.fc2.bias.div_(model.fc2.bias.norm())  # after the forward (the bias is not saved for backward)
    return loss


@pytest.mark.parametrize("precision", ["float64", "native"])
@pytest.mark.parametrize("loss", [_scaled, _clamped, _normalised_after], ids=["mul_", "data-clamp_", "after-forward"])
def test_parameters_the_loss_changes_in_place_are_put_back_and_not_probed(
    loss: Callable[[nn.Module, Any], Tensor], precision: str
) -> None:
    report, _ = _checked(loss, precision=precision)
    edited = "fc2.bias" if loss is _normalised_after else "fc1.weight"
    assert report.verdict == "ok", str(report)  # the edited tensor is left out, not failed
    assert edited not in {p.target for p in report.probes}
    assert any(note.startswith(f"not probed: {edited}") for note in report.notes), report.notes
    assert edited in report.side_effects
    assert not report.unrestored


def test_every_evaluation_starts_from_the_same_parameters() -> None:
    seen: list[float] = []

    def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        seen.append(float(model.fc1.weight.detach().double().sum()))
        return _scaled(model, batch)

    _checked(loss, vectorize=False)
    assert len(seen) > 10
    assert len(set(seen)) == 1  # the edit never accumulates


def test_a_change_that_cannot_be_undone_is_named_in_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copies, "PARAMETER_COPY_LIMIT", 0)  # a model too large to copy
    model = Net()
    original = model.fc1.weight.detach().clone()
    with pytest.warns(UnrestoredStateWarning, match="fc1.weight"):
        report = check_gradients(model, BATCH, _scaled)
    assert report.unrestored == ("fc1.weight (its value before the check: no copy was kept)",)
    assert torch.equal(model.fc1.weight.detach(), original * 1.001)  # the first edit only, not one per evaluation


def _hooked(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    model.fc2.register_forward_hook(lambda module, args, out: out * 2.0)  # 24 hooks after one check, before
    return mse(model, batch)


def _pre_hooked(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    model.fc1.register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
    model.fc1.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    return mse(model, batch)


def _globally_hooked(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    model.fc1.weight.register_hook(lambda grad: grad)
    return mse(model, batch)


def _added(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    model.extra = nn.Linear(3, 3)
    return mse(model, batch)


def _replaced(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    model.fc2 = nn.Linear(8, 3)  # a fresh layer at every call
    return mse(model, batch)


def _rebound(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    model.fc2.weight = nn.Parameter(model.fc2.weight.detach().clone())
    return mse(model, batch)


def _frozen(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    model.fc1.bias.requires_grad_(False)
    return mse(model, batch)


class _Scale(nn.Module):
    def forward(self, weight: Tensor) -> Tensor:
        return weight * 1.0


def _parametrized(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    if not parametrize.is_parametrized(model.fc1):
        parametrize.register_parametrization(model.fc1, "weight", _Scale())  # changes the module's class
    return mse(model, batch)


STRUCTURAL = {
    "forward hook": _hooked,
    "pre-hook and backward hook": _pre_hooked,
    "global and tensor hooks": _globally_hooked,
    "submodule added": _added,
    "submodule replaced": _replaced,
    "parameter rebound": _rebound,
    "requires_grad toggled": _frozen,
    "parametrization registered": _parametrized,
}


@pytest.mark.parametrize("loss", STRUCTURAL.values(), ids=STRUCTURAL.keys())
def test_changes_of_structure_are_undone(loss: Callable[[nn.Module, Any], Tensor]) -> None:
    report, _ = _checked(loss)
    assert report.verdict in ("ok", "inconclusive"), str(report)
    assert report.side_effects, "the change is named"


def test_a_hook_registered_at_every_call_is_evaluated_once_per_evaluation() -> None:
    report, model = _checked(_hooked)
    assert report.verdict == "ok", str(report)
    with torch.no_grad():
        once = F.mse_loss(model.fc2(torch.tanh(model.fc1(BATCH[0]))) * 2.0, BATCH[1])
    assert report.loss == pytest.approx(float(once), rel=1e-6)  # one doubling, not 2**k


def _adam(model: nn.Module) -> torch.optim.Adam:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    mse(model, BATCH).backward()
    optimizer.step()  # state to protect
    return optimizer


@pytest.mark.parametrize("given", [True, False], ids=["optimizers-given", "found-by-its-step"])
def test_a_loss_that_steps_an_optimizer_gets_a_clear_error_and_changes_nothing(given: bool) -> None:
    model = Net()
    optimizer = _adam(model)
    before, state = snapshot(model), copy.deepcopy(optimizer.state_dict())

    def stepping(m: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        optimizer.zero_grad()
        loss = mse(m, batch)
        loss.backward()
        optimizer.step()
        return loss

    with pytest.raises(LossCallsBackwardError, match=r"`loss_fn` must return the loss without calling backward\(\)"):
        check_gradients(model, BATCH, stepping, optimizers=[optimizer] if given else ())
    assert_bit_identical(before, snapshot(model))
    assert str(optimizer.state_dict()) == str(state)
    for (_, saved), now in zip(state["state"].items(), optimizer.state_dict()["state"].values(), strict=True):
        assert all(torch.equal(saved[k], now[k]) for k in saved)


def test_a_loss_that_calls_backward_is_a_value_error_naming_loss_fn() -> None:
    def backward(m: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        loss = mse(m, batch)
        loss.backward()
        return loss

    with pytest.raises(ValueError, match="`loss_fn` must return the loss without calling backward"):
        _checked(backward)


def test_a_learning_rate_the_loss_changes_is_put_back() -> None:
    model = Net()
    optimizer = _adam(model)

    def decaying(m: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        optimizer.param_groups[0]["lr"] *= 0.5  # an LR schedule stepped in training_step
        return mse(m, batch)

    check_gradients(model, BATCH, decaying, optimizers=optimizer)
    assert optimizer.param_groups[0]["lr"] == 1e-2


def test_optimizers_is_validated() -> None:
    with pytest.raises(ValueError, match=r"`optimizers` must be a torch.optim.Optimizer or a list or tuple of them"):
        check_gradients(Net(), BATCH, mse, optimizers=[Net()])  # type: ignore[list-item]


def test_a_model_on_the_meta_device_is_refused_in_gradwatchs_words() -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"`model` must hold real tensors.*meta device.*'weight'"):
        check_gradients(model, BATCH, mse)
    with pytest.raises(ValueError, match=r"`batch` must hold real tensors; got a meta tensor at batch\[0\]"):
        check_gradients(Net(), (torch.empty(6, 4, device="meta"), BATCH[1]), mse)


class Autoencoder(nn.Module):
    def __init__(self, weight_scale: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(6, 3)
        self.decoder = nn.Linear(3, 6)
        self.weight_scale = weight_scale  # != 1: a planted bug in the decoder's weight gradient

    def forward(self, x: Tensor) -> Tensor:
        code = torch.tanh(self.encoder(x))
        d = self.decoder
        if self.weight_scale == 1.0:
            return torch.sigmoid(d(code))  # vectorisable
        return torch.sigmoid(ScaledLinearFunction.apply(code, d.weight, d.bias, self.weight_scale, 1.0))


def _reconstruction(model: nn.Module, x: Tensor) -> Tensor:
    return F.binary_cross_entropy(model(x), x)  # the input is the target: it must stay in [0, 1]


def _float_labels(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.binary_cross_entropy(model(batch[0]), batch[1])  # labels stored as floats


PIXELS = (torch.rand(8, 6, generator=torch.Generator().manual_seed(2)) > 0.5).float()  # binarised, as MNIST VAEs
CONSTRAINED = {
    "autoencoder": (_reconstruction, PIXELS),
    "float labels": (_float_labels, (torch.randn(8, 6), PIXELS)),
}


@pytest.mark.parametrize(("loss", "batch"), CONSTRAINED.values(), ids=CONSTRAINED.keys())
@pytest.mark.parametrize("precision", ["float64", "native"])
def test_inputs_the_loss_refuses_displaced_cost_the_input_probes_not_the_check(
    loss: Callable[[nn.Module, Any], Tensor], batch: Any, precision: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = check_gradients(Autoencoder(), batch, loss, precision=precision, input_probes=3)
    assert report.verdict == "ok", str(report)
    assert report.probes
    assert not any(p.kind == "input" for p in report.probes)
    assert any(note.startswith("input probes skipped: the loss refuses displaced inputs") for note in report.notes)
    assert not any("vectorised" in note for note in report.notes), report.notes  # the refusal is not vmap's
    assert report.vectorized is (True if precision == "float64" else None)
    buggy = check_gradients(Autoencoder(weight_scale=1.05), batch, loss, precision=precision)
    assert buggy.verdict == "fail", str(buggy)  # still checked, failures confirmed without moving the inputs
    assert {p.target for p in buggy.failures} & {"decoder.weight", "descent"}
