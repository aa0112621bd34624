"""check_gradients: verdicts on correct and buggy models, exact restoration, batches, bad input."""

from __future__ import annotations

import collections
import dataclasses
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    DropoutBatchNormNet,
    SeedModel,
    assert_bit_identical,
    classification_batch,
    cross_entropy_loss,
    seed_batch,
    seed_loss,
    snapshot,
)
from torch import nn

from gradwatch import CheckReport, check_gradients
from gradwatch.engine.function import precision as precision_module
from gradwatch.engine.results.notes import NoteCode, codes
from gradwatch.engine.results.report import Probe


def test_seed_case_is_not_a_false_alarm() -> None:
    # MSELoss(reduction="sum") over a 140x120 float32 tensor: naive float32 probes read 10-100% errors here
    report = check_gradients(SeedModel(), seed_batch(), seed_loss)
    assert report.loss > 1e4
    assert report.verdict == "ok", str(report)
    assert report.count("fail") == 0
    assert max(report.conclusive_rel_errors) < 1e-3
    assert report.descent_ratio == pytest.approx(1.0, abs=1e-4)


def test_weight_gradient_ten_percent_off_fails_and_names_the_weight() -> None:
    report = check_gradients(SeedModel(weight_scale=1.1), seed_batch(), seed_loss)
    assert report.verdict == "fail"
    failing_params = {p.target for p in report.failures if p.kind == "param"}
    assert failing_params == {"fc.weight"}, str(report)
    assert all(p.verdict == "ok" for p in report.probes if p.target == "fc.bias")
    assert report.descent.verdict == "fail"


def test_one_percent_error_is_detected() -> None:
    report = check_gradients(SeedModel(weight_scale=1.01), seed_batch(), seed_loss)
    assert report.verdict == "fail"
    assert "fc.weight" in {p.target for p in report.failures}
    assert report.descent_ratio == pytest.approx(0.99, abs=2e-3)


def test_sign_flipped_gradient_fails_the_descent_check() -> None:
    report = check_gradients(SeedModel(sign=-1.0), seed_batch(), seed_loss)
    descent = report.descent
    assert descent is not None
    assert descent.kind == "descent"
    assert descent.target == "*"
    assert descent.index is None
    assert descent.verdict == "fail"
    assert report.descent_ratio == pytest.approx(-1.0, abs=1e-3)
    assert report.verdict == "fail"


def test_dropout_and_batchnorm_no_false_alarm_and_state_bit_identical() -> None:
    torch.manual_seed(0)
    model = DropoutBatchNormNet()
    batch = classification_batch()
    model.train()
    cross_entropy_loss(model, batch).backward()  # a .grad to preserve, as in training
    torch.rand(3)  # move the generators somewhere arbitrary
    before = snapshot(model)
    reports = [check_gradients(model, batch, cross_entropy_loss, step=step) for step in range(5)]
    assert_bit_identical(before, snapshot(model))
    assert all(r.verdict != "fail" for r in reports), "\n".join(str(r) for r in reports)
    assert all(r.descent_ratio == pytest.approx(1.0, abs=1e-3) for r in reports)


def test_dropout_masks_are_replayed() -> None:
    # without replaying the random state, every evaluation would draw new masks and nothing would agree
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.Linear(64, 4))
    report = check_gradients(model, classification_batch(), cross_entropy_loss)
    assert report.verdict == "ok", str(report)


class _FailingLoss:
    """Raises ``error`` from the ``fail_at``-th call on (the reference pass is call 1)."""

    def __init__(self, fail_at: int, error: BaseException) -> None:
        self.calls = 0
        self.fail_at = fail_at
        self.error = error

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        if self.calls >= self.fail_at:
            raise self.error
        return cross_entropy_loss(model, batch)


@pytest.mark.parametrize(
    ("fail_at", "vectorize"),
    [(1, True), (2, True), (3, True), (5, False), (12, False)],
    ids=["reference", "reproducibility", "vectorised-pass", "descent", "coordinate"],
)
@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()], ids=["exception", "keyboard-interrupt"])
def test_failure_inside_a_probe_restores_everything(fail_at: int, vectorize: bool, error: BaseException) -> None:
    # an exception in the vectorised pass (call 3) sends the check to point-by-point evaluation, whose first call raises
    torch.manual_seed(0)
    model = DropoutBatchNormNet()
    batch = classification_batch()
    cross_entropy_loss(model, batch).backward()
    before = snapshot(model)
    with pytest.raises(type(error)):
        check_gradients(model, batch, _FailingLoss(fail_at, error), vectorize=vectorize)
    assert_bit_identical(before, snapshot(model))


@pytest.mark.parametrize("precision", ["native", "float64"])
def test_bias_before_batchnorm_is_not_a_false_alarm(precision: str) -> None:
    # the bias's true derivative is 0; float32 autograd returns round-off (~1e-8) that float64 probes measure as 0
    torch.manual_seed(0)
    model = DropoutBatchNormNet()
    batch = classification_batch()
    reports = [
        check_gradients(model, batch, cross_entropy_loss, step=step, tensor_probes=5, precision=precision)  # type: ignore[arg-type]
        for step in range(4)
    ]
    bias_probes = [p for r in reports for p in r.probes if p.target == "net.0.bias"]
    assert bias_probes
    assert all(r.verdict != "fail" for r in reports), "\n".join(str(r) for r in reports)
    if precision == "float64":
        # float64 resolves the zero derivative, and float32 round-off far below the model's gradient agrees with it
        assert all(p.verdict == "ok" for p in bias_probes), bias_probes


def test_float64_model_is_checked_to_float64_precision() -> None:
    torch.manual_seed(0)
    model = DropoutBatchNormNet().double()
    inputs, labels = classification_batch()
    report = check_gradients(model, (inputs.double(), labels), cross_entropy_loss)
    assert report.verdict == "ok", str(report)
    assert report.descent_ratio == pytest.approx(1.0, abs=1e-7)


def test_unused_parameter_without_gradient_is_fine() -> None:
    class WithUnused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(16, 4)
            self.unused = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    report = check_gradients(WithUnused(), classification_batch(), cross_entropy_loss, param_probes=8)
    unused = [p for p in report.probes if p.target.startswith("unused")]
    assert unused, "the stratified sampling should reach the unused tensors"
    assert all(p.verdict == "ok" and p.analytic == 0.0 and p.numeric == 0.0 for p in unused)
    assert report.verdict == "ok"


Sample = collections.namedtuple("Sample", ["pixels", "label"])


@dataclasses.dataclass(frozen=True)
class Example:
    features: torch.Tensor
    mask: torch.Tensor
    tokens: torch.Tensor


def test_inputs_are_found_in_nested_batches_and_integer_tensors_skipped() -> None:
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 8)
    head = nn.Linear(16, 1)
    model = nn.ModuleDict({"embedding": embedding, "head": head})
    batch = {
        "sample": Sample(pixels=torch.randn(6, 8), label=torch.randn(6, 1)),
        "example": Example(
            features=torch.randn(6, 8), mask=torch.ones(6, 8, dtype=torch.bool), tokens=torch.randint(0, 10, (6,))
        ),
    }

    def loss_fn(model: nn.ModuleDict, batch: dict) -> torch.Tensor:
        example = batch["example"]
        tokens = model["embedding"](example.tokens) * example.mask
        features = torch.cat([batch["sample"].pixels + tokens, example.features], dim=1)
        return F.mse_loss(model["head"](features), batch["sample"].label)

    report = check_gradients(model, batch, loss_fn, input_probes=30, param_probes=0)
    targets = {p.target for p in report.probes if p.kind == "input" and p.index is not None}
    assert targets == {"batch['sample'].pixels", "batch['sample'].label", "batch['example'].features"}
    assert {p.target for p in report.probes if p.kind == "input" and p.index is None} == {"batch"}
    assert report.verdict == "ok", str(report)


def test_batch_is_not_modified_even_by_a_loss_that_mutates_its_inputs() -> None:
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    batch = classification_batch()
    original = batch[0].clone()

    def mutating_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, labels = batch
        with torch.no_grad():
            inputs.mul_(2.0)  # an in-place "normalisation"
        return F.cross_entropy(model(inputs), labels)

    report = check_gradients(model, batch, mutating_loss)
    assert torch.equal(batch[0], original)
    assert report.verdict == "ok", str(report)


def test_same_seed_and_step_probe_the_same_coordinates() -> None:
    def coordinates(report: CheckReport) -> list[tuple[str, object]]:
        return [(p.target, p.index) for p in report.probes]

    first = check_gradients(SeedModel(), seed_batch(), seed_loss, step=7, seed=3)
    again = check_gradients(SeedModel(), seed_batch(), seed_loss, step=7, seed=3)
    other = check_gradients(SeedModel(), seed_batch(), seed_loss, step=8, seed=3)
    assert coordinates(first) == coordinates(again)
    assert coordinates(first) != coordinates(other)


@pytest.mark.parametrize("vectorize", [False, True], ids=["point-by-point", "vectorised"])
def test_healthy_check_is_a_cheap_screen_and_counts_its_cost(vectorize: bool) -> None:
    torch.manual_seed(0)
    report = check_gradients(
        nn.Linear(64, 120),
        seed_batch(),
        seed_loss,
        tensor_probes=2,
        random_probes=1,
        param_probes=4,
        input_probes=2,
        vectorize=vectorize,
    )
    assert report.verdict == "ok", str(report)
    # reference + centre, the descent probe's 4 points, then 2 points per screen: 2 tensor, 1 random, 4 coordinate
    # and 2 input probes (along the inputs' gradient, one coordinate), none of which needed more
    assert [p.kind for p in report.probes].count("param") == 4
    assert len(report.probes) == 1 + 2 + 1 + 4 + 2
    assert report.n_backward == 1
    assert report.duration_s > 0
    if vectorize:
        # two passes: the 8 points of the descent and input probes (they move the whole network) with the centre again,
        # which the pass must reproduce, then the 14 points of the screens that move one parameter
        assert (report.n_forward, report.n_passes, report.vectorized) == (2 + 1 + 4 + 2 * 9, 2 + 2, True)
    else:
        assert (report.n_forward, report.n_passes, report.vectorized) == (2 + 4 + 2 * 9, 2 + 4 + 2 * 9, None)


def test_scalars_have_a_fixed_set_of_tags() -> None:
    healthy = check_gradients(SeedModel(), seed_batch(), seed_loss).scalars()
    buggy = check_gradients(SeedModel(weight_scale=1.1), seed_batch(), seed_loss).scalars()
    assert healthy.keys() == buggy.keys()
    assert healthy["gradwatch/verdict"] == 0.0
    assert buggy["gradwatch/verdict"] == 2.0
    assert buggy["gradwatch/failing_probes"] >= 1
    assert all(isinstance(v, float) and not math.isnan(v) for v in healthy.values())


def test_bad_loss_outputs_raise_clear_errors() -> None:
    model = nn.Linear(16, 4)
    batch = classification_batch()
    with pytest.raises(TypeError, match=r"loss_fn must return a scalar torch\.Tensor; got float"):
        check_gradients(model, batch, lambda m, b: 1.0)
    with pytest.raises(ValueError, match=r"scalar tensor; got a tensor of shape \(32, 4\)"):
        check_gradients(model, batch, lambda m, b: m(b[0]))
    with pytest.raises(ValueError, match="does not require grad"):
        check_gradients(model, batch, lambda m, b: cross_entropy_loss(m, b).detach())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step": -1}, "`step` must be an integer >= 0; got -1"),
        ({"step": 1.5}, r"`step` must be an integer >= 0; got 1.5 \(float\)"),
        ({"param_probes": -2}, "`param_probes` must be an integer >= 0"),
        ({"input_probes": True}, r"`input_probes` must be an integer >= 0; got True \(bool\)"),
        ({"rtol": 0.0}, "`rtol` must be None or a number strictly between 0 and 1; got 0.0"),
        ({"rtol": "tight"}, "`rtol` must be None or a number"),
        ({"seed": -1}, "`seed` must be an integer >= 0"),
        ({"rotation": -3}, "`rotation` must be None or an integer >= 0"),
        ({"float64_reductions": 1}, "`float64_reductions` must be True or False; got 1"),
        ({"vectorize": "yes"}, "`vectorize` must be True or False; got 'yes'"),
    ],
    ids=[
        "step-negative",
        "step-float",
        "param-probes",
        "input-probes-bool",
        "rtol-zero",
        "rtol-str",
        "seed",
        "rotation",
        "reductions",
        "vectorize",
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_gradients(nn.Linear(16, 4), classification_batch(), cross_entropy_loss, **kwargs)


def test_bad_model_and_loss_fn_types() -> None:
    with pytest.raises(TypeError, match=r"`model` must be a torch\.nn\.Module; got function"):
        check_gradients(lambda x: x, classification_batch(), cross_entropy_loss)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`loss_fn` must be callable"):
        check_gradients(nn.Linear(16, 4), classification_batch(), "mse")  # type: ignore[arg-type]


def test_auto_precision_probes_in_float64_up_to_the_size_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, batch = DropoutBatchNormNet(), classification_batch()
    assert check_gradients(model, batch, cross_entropy_loss).precision == "float64"
    assert check_gradients(model, batch, cross_entropy_loss, precision="native").precision == "native"
    monkeypatch.setattr(precision_module, "AUTO_FLOAT64_ELEMENTS", 100)  # the model has 740 elements
    assert check_gradients(model, batch, cross_entropy_loss).precision == "native"


def _offset_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # both sides shifted by 1e3 inside the float32 computation: the float32 loss is a staircase of ~1e-4 steps, while
    # autograd's gradient (and the float64 loss) are those of the smooth function
    return F.mse_loss(model(batch[0]) + 1e3, batch[1] + 1e3)


def test_beyond_the_size_limit_undecided_probes_are_measured_again_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision_module, "AUTO_FLOAT64_ELEMENTS", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    batch = (torch.randn(32, 8), torch.randn(32, 4))
    native = check_gradients(model, batch, _offset_loss, precision="native")
    assert native.count("inconclusive") >= 4, str(native)  # the staircase defeats float32 finite differences
    auto = check_gradients(model, batch, _offset_loss)
    assert auto.precision == "native"
    assert auto.noted(NoteCode.REMEASURED_IN_FLOAT64), auto.notes
    parameter_probes = [p for p in auto.probes if p.kind != "input"]
    assert all(p.verdict == "ok" for p in parameter_probes), str(auto)
    model[2].weight.register_hook(lambda g: g * 1.01)
    buggy = check_gradients(model, batch, _offset_loss)
    assert {p.target for p in buggy.failures if p.kind == "tensor"} == {"2.weight"}, str(buggy)


def test_focus_adds_a_probe_along_each_named_tensor() -> None:
    torch.manual_seed(0)
    model, batch = DropoutBatchNormNet(), classification_batch()
    report = check_gradients(model, batch, cross_entropy_loss, tensor_probes=0, focus=["net.4.weight", "net.1.bias"])
    assert sorted(p.target for p in report.probes if p.kind == "tensor") == ["net.1.bias", "net.4.weight"]
    # a name the model no longer has (a checkpoint from a renamed layer) is dropped with a note, never the check
    stale = check_gradients(model, batch, cross_entropy_loss, tensor_probes=0, focus=["net.9.weight", "net.1.bias"])
    assert stale.verdict == "ok"
    assert [p.target for p in stale.probes if p.kind == "tensor"] == ["net.1.bias"]
    assert any("`focus` named ['net.9.weight']" in note for note in stale.notes), stale.notes
    with pytest.raises(ValueError, match="`focus` must be a list or tuple"):
        check_gradients(model, batch, cross_entropy_loss, focus="net.4.weight")  # type: ignore[arg-type]


def test_undecided_names_the_tensors_whose_own_probe_could_not_decide() -> None:
    def probe(kind: str, target: str, verdict: str, reason: str) -> Probe:
        return Probe(kind, target, None, 1.0, 1.0, 0.0, verdict=verdict, noise=0.0, step=0.0, reason=reason)  # type: ignore[arg-type]

    report = CheckReport(
        step=0,
        verdict="ok",
        probes=[
            probe("descent", "*", "inconclusive", "kink"),
            probe("tensor", "a", "inconclusive", "kink"),
            probe("tensor", "b", "ok", "agrees"),
            probe("tensor", "c", "inconclusive", "unresolved"),
            probe("tensor", "d", "inconclusive", "flat"),  # a staircase loss: probing again does not help
            probe("random", "e", "inconclusive", "kink"),
            probe("tensor", "a", "inconclusive", "unstable"),
        ],
        loss=1.0,
        n_forward=1,
        n_backward=1,
        duration_s=0.0,
    )
    assert report.undecided == ("a", "c")


def _memorised(loss_below: float) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A ReLU net trained on one sample until its cross-entropy is below ``loss_below``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    batch = classification_batch(samples=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    while (loss := cross_entropy_loss(model, batch)).item() >= loss_below:
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, batch


def test_memorised_sample_is_judged_with_the_tolerance_its_rounding_allows() -> None:
    # the float32 gradient p - 1 of a confident prediction carries an absolute error of ~ε, a relative error of ~ε/L
    # (1e-3 at L = 1e-4), which float64 probes measure exactly: that is autograd's rounding, not a wrong gradient
    model, batch = _memorised(2e-4)
    report = check_gradients(model, batch, cross_entropy_loss)
    assert report.precision == "float64"
    assert report.rtol == pytest.approx(4 * torch.finfo(torch.float32).eps / report.loss)
    assert report.rtol > 2e-3
    assert report.verdict == "ok", str(report)
    model[2].weight.register_hook(lambda g: g * 1.1)  # a 10% error still stands out
    assert {p.target for p in check_gradients(model, batch, cross_entropy_loss).failures if p.kind == "tensor"} == {
        "2.weight"
    }


def test_loss_too_close_to_zero_to_check_makes_no_probe() -> None:
    model, batch = _memorised(5e-6)
    report = check_gradients(model, batch, cross_entropy_loss)
    assert report.verdict == "inconclusive"
    assert report.probes == []
    assert report.n_forward == 1  # the reference alone
    assert codes(report.notes)[-1] == NoteCode.LOSS_NEAR_ZERO, report.notes
    assert "float32" in report.notes[-1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_model_is_probed_in_float64_and_catches_a_gross_error(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)
    inputs, labels = classification_batch()
    batch = (inputs.to(dtype), labels)
    report = check_gradients(model, batch, cross_entropy_loss)
    assert report.precision == "float64"
    # the tolerance is measured on the model (at most the fixed 16-bit one): see tests/engine/test_low_precision.py
    assert report.rtol <= (3e-2 if dtype == torch.float16 else 1e-1)
    assert report.verdict == "ok", str(report)
    model[0].weight.register_hook(lambda g: g * 1.5)
    buggy = check_gradients(model, batch, cross_entropy_loss, tensor_probes=4)
    assert "0.weight" in {p.target for p in buggy.failures}, str(buggy)


def test_loss_drawing_from_numpy_and_python_generators_is_replayed_at_every_point() -> None:
    # noise drawn from the global generators: reproducible only if every evaluation replays them
    def noisy_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        scale = 1 + 1e-3 * float(np.random.rand()) + 1e-3 * random.random()
        return cross_entropy_loss(model, batch) * scale

    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    for vectorize in (False, True):
        report = check_gradients(model, classification_batch(), noisy_loss, vectorize=vectorize)
        assert report.verdict == "ok", str(report)
        assert not report.notes, report.notes


def test_warnings_the_loss_raises_during_a_check_are_withheld_and_noted() -> None:
    import warnings

    torch.manual_seed(0)
    model = nn.Linear(16, 4)

    def warning_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        warnings.warn("the loss warns at every call", UserWarning, stacklevel=1)
        return cross_entropy_loss(model, batch)

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        report = check_gradients(model, classification_batch(), warning_loss)
    assert shown == []
    (note,) = report.noted(NoteCode.WARNINGS_WITHHELD)
    assert "UserWarning: the loss warns at every call" in note, report.notes  # the first warning, shown
    assert report.verdict == "ok"
