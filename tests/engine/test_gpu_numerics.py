"""A GPU's numerics, emulated on the CPU (:mod:`tests.gpu_emulation`), in every verdict: TF32 matmuls and
convolutions, a backward that sums in a random order (atomics), kernels that refuse float64 or compute it in float32.
Healthy models raise no alarm under them, a 3% backward bug is caught at the first check, and every report records
the settings that change the numbers (``report.numerics``), in the JSON lines record and ``gradwatch report``."""

from __future__ import annotations

import collections
import contextlib
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from gradwatch import GradientWatch, check_applied_gradient
from gradwatch.cli.reporting import format_run
from gradwatch.engine.results.numerics import Numerics, current_numerics, describe_numerics
from gradwatch.outputs.jsonl import record_json, record_numerics
from gradwatch.outputs.reading import read_logdir
from gradwatch.outputs.records import report_records
from gradwatch.outputs.sinks import JsonLinesSink
from tests.gpu_emulation import (
    Bf16OnlyRMSNorm,
    Bf16RMSNormKernel,
    Float32Inside,
    OpaqueFloat32Inside,
    RefusesFloat64,
    ShuffledLinear,
    TF32Emulation,
    tf32,
)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class BuggyConv(nn.Conv2d):
    """A convolution whose backward is wrong by ``factor`` (1: right)."""

    def __init__(self, *args: Any, factor: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_ScaleGrad.apply(x, self.factor) if self.factor != 1.0 else x)


class CNN(nn.Module):
    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = BuggyConv(6, 6, 3, padding=1, factor=factor)
        self.head = nn.Linear(6 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.avg_pool2d(torch.tanh(self.conv1(x)), 2)
        x = nn.functional.avg_pool2d(torch.tanh(self.conv2(x)), 2)
        return self.head(x.flatten(1))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)).mean(1))


def _images(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, 3, 16, 16, generator=generator), torch.randint(0, 5, (6,), generator=generator)


def _sequences(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, 4, 8, generator=generator), torch.randint(0, 5, (6,), generator=generator)


def _vectors(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 16, generator=generator), torch.randint(0, 5, (8,), generator=generator)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _bf16_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return nn.functional.cross_entropy(model(batch[0]).float(), batch[1])


def train(model: nn.Module, batches: Callable[[torch.Generator], Any], steps: int, loss_fn=_loss,
          mode: contextlib.AbstractContextManager[Any] | None = None, **options: Any) -> GradientWatch:  # fmt: skip
    """``steps`` SGD steps with a recomputed and an applied check at each, in a plain loop, under ``mode``."""
    generator = torch.Generator().manual_seed(3)
    watch = GradientWatch(every_n_steps=1, applied_every_n_steps=1, max_overhead=None, verbose=False, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with mode or contextlib.nullcontext():
        for step in range(1, steps + 1):
            batch = batches(generator)
            watch.record(batch)
            loss_fn(model, batch).backward()
            watch.before_optimizer_step(model, loss_fn, step=step)
            optimizer.step()
            optimizer.zero_grad()
            watch.maybe_check(model, batch, loss_fn, step=step)
    return watch


def _checks(watch: GradientWatch) -> list:
    """The recomputed and applied checks' reports (not those of other scopes)."""
    return [*watch.recomputed_reports, *watch.applied_reports]


def _tally(watch: GradientWatch) -> collections.Counter:
    return collections.Counter((r.scope, r.verdict) for r in watch.reports)


def _seeded(make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return make()


def test_tf32_rounds_to_ten_mantissa_bits():
    x = torch.tensor([1.0 + 2**-11, 1.0 + 2**-10 + 2**-11, 3.14159265])
    rounded = tf32(x)
    assert rounded[0] == 1.0
    assert rounded[1] == 1.0 + 2**-9
    assert abs(rounded[2] - x[2]) <= 2**-11 * 2
    assert rounded[2] != x[2]


def test_the_emulation_rounds_only_where_the_settings_allow_tf32():
    a, b = torch.randn(32, 32, dtype=torch.float32), torch.randn(32, 32)
    with TF32Emulation() as emulation:
        rounded = a @ b
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        exact = a @ b
    assert emulation.rounded == 1
    assert torch.equal(exact, a @ b)
    assert not torch.equal(rounded, exact)
    assert 1e-4 < ((rounded - exact).norm() / exact.norm()).item() < 1e-2


@pytest.mark.parametrize(
    ("make", "batches", "loss_fn", "steps"),
    [
        pytest.param(CNN, _images, _loss, 3, marks=pytest.mark.slow, id="cnn"),
        pytest.param(Transformer, _sequences, _loss, 3, id="transformer"),
        pytest.param(CNN, _images, _bf16_loss, 2, marks=pytest.mark.slow, id="cnn-bf16-mixed"),
    ],
)
def test_healthy_models_under_tf32_raise_no_alarm(make, batches, loss_fn, steps):
    emulation = TF32Emulation()
    watch = train(_seeded(make), batches, steps, loss_fn, emulation)
    assert emulation.rounded > 0
    tally = _tally(watch)
    assert (tally[("recomputed", "fail")], tally[("applied", "fail")]) == (0, 0), [str(r) for r in watch.reports]
    assert (tally[("recomputed", "ok")], tally[("applied", "ok")]) == (steps, steps), tally
    for report in [*watch.recomputed_reports, *watch.applied_reports]:
        assert report.numerics is not None
        assert report.numerics.matmul == "tf32"
        assert report.numerics.cudnn_conv == "tf32"


@pytest.mark.slow
@pytest.mark.parametrize(("make", "batches"), [(CNN, _images), (Transformer, _sequences)], ids=["cnn", "transformer"])
def test_fifty_healthy_checks_of_each_kind_under_tf32(make, batches):
    watch = train(_seeded(make), batches, 50, mode=TF32Emulation(), max_reports=200)
    tally = _tally(watch)
    assert (tally[("recomputed", "fail")], tally[("applied", "fail")]) == (0, 0), tally
    assert min(tally[("recomputed", "ok")], tally[("applied", "ok")]) >= 48, tally


@pytest.mark.slow
def test_a_three_percent_backward_bug_in_the_tf32_layer_is_caught_at_the_first_check():
    watch = train(_seeded(lambda: CNN(factor=1.03)), _images, 1, mode=TF32Emulation())
    (applied,) = watch.applied_reports
    (recomputed,) = watch.recomputed_reports
    assert applied.verdict == "fail"
    assert recomputed.verdict == "fail"
    assert recomputed.culprits[0] == "conv2", recomputed.culprit_message


@pytest.mark.parametrize("steps", [4])
def test_a_backward_summing_in_a_random_order_is_noise(steps):
    torch.manual_seed(0)
    model = nn.Sequential(ShuffledLinear(16, 32), nn.Tanh(), nn.Linear(32, 5))
    first = torch.autograd.grad(_loss(model, _vectors(torch.Generator().manual_seed(0))), model[0].weight)[0]
    again = torch.autograd.grad(_loss(model, _vectors(torch.Generator().manual_seed(0))), model[0].weight)[0]
    assert not torch.equal(first, again)  # the emulation does sum otherwise at every call
    watch = train(model, _vectors, steps)
    assert all(r.verdict == "ok" for r in _checks(watch)), [str(r) for r in _checks(watch)]
    assert not [r for r in watch.reports if r.fault is not None]


@pytest.mark.parametrize("kernel", [RefusesFloat64, Float32Inside], ids=["refuses-float64", "float32-inside"])
def test_kernels_without_float64_raise_no_alarm_and_their_three_percent_bug_is_caught(kernel):
    torch.manual_seed(0)
    healthy = train(nn.Sequential(nn.Linear(16, 32), kernel(), nn.Linear(32, 5)), _vectors, 3)
    assert all(r.verdict == "ok" for r in _checks(healthy)), [str(r) for r in _checks(healthy)]
    torch.manual_seed(0)
    buggy = train(nn.Sequential(nn.Linear(16, 32), kernel(factor=1.03), nn.Linear(32, 5)), _vectors, 1)
    assert all(r.verdict == "fail" for r in _checks(buggy)), [str(r) for r in _checks(buggy)]
    if kernel is RefusesFloat64:
        assert all(r.precision == "native" for r in buggy.recomputed_reports)
    named = [r.culprits[0] for r in _checks(buggy) if r.culprits]
    assert named, [r.culprit_message for r in _checks(buggy)]
    assert all(name == "1" for name in named), [r.culprit_message for r in _checks(buggy)]


def test_numerics_are_read_as_set_and_described():
    with TF32Emulation(conv=False):
        found = current_numerics()
    assert found.matmul == "tf32"
    assert found.reduced_on("cpu") == ("matmul",)
    assert current_numerics().matmul == "ieee"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert current_numerics().autocast == "cpu:bfloat16"
    text = found.describe()
    assert "float32 matmul tf32" in text
    assert "autocast off" in text
    assert describe_numerics(json.loads(json.dumps(found.as_dict()))) == text
    assert Numerics(**{k: tuple(v) if isinstance(v, list) else v for k, v in found.as_dict().items()}) == found


def test_numerics_are_in_the_json_lines_record_and_gradwatch_report(tmp_path):
    watch = train(_seeded(CNN), _images, 2, mode=TF32Emulation(), sinks=[JsonLinesSink(tmp_path / "gradwatch.jsonl")])
    watch.flush()
    report = watch.recomputed_reports[-1]
    record = record_json(report_records(report, 0.0))
    assert record["numerics"]["matmul"] == "tf32"
    assert record["numerics"]["cudnn_conv"] == "tf32"
    assert record_numerics(record) == report.numerics.describe()
    (run,) = read_logdir(tmp_path)
    shown = format_run(run)
    assert "numerics (steps 1 to 2, 2 checks): float32 matmul tf32, float32 cudnn conv tf32" in shown, shown


class PureBf16(nn.Module):
    """A residual MLP block around a bf16-only fused RMSNorm, for pure-bf16 training (``.to(torch.bfloat16)``)."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.embed, self.norm = nn.Linear(16, 32), Bf16OnlyRMSNorm(32, factor)
        self.up, self.down, self.head = nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(h + self.down(nn.functional.gelu(self.up(self.norm(h)))))


class FusedBlock(nn.Module):
    """A block whose own forward calls the bf16-only RMSNorm kernel between two linear layers: the refusing module is
    the block, a nonlinear function of its weights, whose probes moved 10% at once read a healthy block 3-10% off
    (truncation) before the step came down until two measurements agreed."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)
        self.weight = nn.Parameter(torch.ones(32))
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = Bf16RMSNormKernel.apply(self.a(x), self.weight, self.factor)
        return x + self.b(nn.functional.gelu(normed))


class WithFusedBlock(nn.Module):
    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.embed, self.block, self.head = nn.Linear(16, 32), FusedBlock(factor), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)))


def _bf16_vectors(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 16, generator=generator).bfloat16(), torch.randint(0, 5, (8,), generator=generator)


def _float_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]).float(), batch[1])


def train_pure_bf16(factor: float, steps: int, watched: bool = True, make: Callable[[float], nn.Module] = PureBf16,
                    ) -> tuple[nn.Module, Any, GradientWatch | None]:  # fmt: skip
    """``steps`` AdamW steps of the bf16 ``make(factor)`` (:class:`PureBf16`) in a plain loop, both checks at every
    step (``watched``)."""
    model = _seeded(lambda: make(factor)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = GradientWatch(every_n_steps=1, applied_every_n_steps=1, max_overhead=None, verbose=False,
                          max_reports=500) if watched else None  # fmt: skip
    generator = torch.Generator().manual_seed(3)
    for step in range(1, steps + 1):
        batch = _bf16_vectors(generator)
        if watch is not None:
            watch.record(batch)
        _float_loss(model, batch).backward()
        if watch is not None:
            watch.before_optimizer_step(model, _float_loss, step=step)
        optimizer.step()
        optimizer.zero_grad()
        if watch is not None:
            watch.maybe_check(model, batch, _float_loss, step=step)
    return model, optimizer, watch


def _kernel_probes(report: Any) -> list:
    return [p for p in report.probes if p.kind in ("module_input", "module_params") and p.target == "norm"]


def test_the_bf16_only_kernel_refuses_float32_and_float64():
    norm = Bf16OnlyRMSNorm(4)
    for dtype in (torch.float32, torch.float64):
        with pytest.raises(RuntimeError, match="expected BFloat16"):
            norm.to(dtype)(torch.randn(2, 4, dtype=dtype))


def test_pure_bf16_a_five_percent_bug_in_a_bf16_only_kernel_is_caught_and_named_at_the_first_check():
    _, _, watch = train_pure_bf16(1.05, 1)
    (recomputed,) = watch.recomputed_reports
    assert recomputed.verdict == "fail", str(recomputed)
    assert recomputed.precision == "native"  # the loss refuses float64
    assert recomputed.culprits[0] == "norm", recomputed.culprit_message
    assert "its input gradient is" in recomputed.culprit_message
    (failing,) = [p for p in _kernel_probes(recomputed) if p.verdict == "fail"]
    assert failing.kind == "module_input"
    assert 0.03 < failing.rel_error < 0.07, failing
    assert all(p.verdict != "fail" for p in recomputed.probes if p.kind not in ("module_input", "module_params"))


def test_pure_bf16_healthy_bf16_only_kernel_checks_agree_in_isolation():
    _, _, watch = train_pure_bf16(1.0, 3)
    assert all(r.verdict != "fail" for r in _checks(watch)), [str(r) for r in _checks(watch)]
    for report in watch.recomputed_reports:
        probes = _kernel_probes(report)
        assert {p.kind for p in probes} == {"module_input", "module_params"}, report.probes
        assert all(p.verdict == "ok" and p.rel_error < 0.01 for p in probes), probes


@pytest.mark.slow
def test_pure_bf16_with_a_bf16_only_kernel_thirty_healthy_checks_and_bit_identical_training():
    model, optimizer, watch = train_pure_bf16(1.0, 30)
    plain, plain_optimizer, _ = train_pure_bf16(1.0, 30, watched=False)
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(optimizer.state.values(), plain_optimizer.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq"))
    tally = _tally(watch)
    assert (tally[("recomputed", "fail")], tally[("applied", "fail")]) == (0, 0), tally
    # at most 20% of each kind inconclusive: the recomputed check's bf16 probes along directions step 2x longer
    # (SIXTEEN_BIT_DIRECTION_STEP), where 13 of 30 had ended inconclusive, their round-off 1.5% of the slope
    assert max(tally[("applied", "inconclusive")], tally[("recomputed", "inconclusive")]) <= 30 * 0.2, tally
    assert all(p.verdict == "ok" for r in watch.recomputed_reports for p in _kernel_probes(r))


@pytest.mark.slow
def test_pure_bf16_a_fused_block_around_a_bf16_only_kernel_raises_no_false_alarm_and_its_bug_is_caught():
    _, _, healthy = train_pure_bf16(1.0, 3, make=WithFusedBlock)
    assert all(r.verdict != "fail" for r in _checks(healthy)), [str(r) for r in _checks(healthy)]
    probes = [p for r in healthy.recomputed_reports for p in r.probes if p.kind in ("module_input", "module_params")]
    assert {p.target for p in probes} == {"block"}
    assert all(p.verdict == "ok" for p in probes), probes
    _, _, buggy = train_pure_bf16(1.05, 3, make=WithFusedBlock)
    failing = [r for r in buggy.recomputed_reports if r.verdict == "fail"]
    assert failing, [str(r) for r in buggy.recomputed_reports]  # within 3 checks
    assert all(r.culprits[0] == "block" for r in failing), [r.culprit_message for r in failing]


def test_a_kernel_computing_float64_in_float32_out_of_sight_is_probed_natively_by_the_applied_check_too():
    """Float64 fidelity keeps a visible ``.float()`` at float64 (:class:`Float32Inside` then computes float64); a
    Triton kernel's float32 it cannot see. The applied check's float64 probes through it read a 3% bug ``ok``
    (noise 0.8% of the slope, claimed float64) until they verified that the loss was computed in float64."""
    torch.manual_seed(0)
    healthy = train(nn.Sequential(nn.Linear(16, 32), OpaqueFloat32Inside(), nn.Linear(32, 5)), _vectors, 2)
    assert all(r.verdict == "ok" for r in _checks(healthy)), [str(r) for r in _checks(healthy)]
    torch.manual_seed(0)
    buggy = train(nn.Sequential(nn.Linear(16, 32), OpaqueFloat32Inside(factor=1.03), nn.Linear(32, 5)), _vectors, 1)
    assert all(r.verdict == "fail" for r in _checks(buggy)), [str(r) for r in _checks(buggy)]
    for report in [*healthy.applied_reports, *buggy.applied_reports]:
        assert report.precision == "native"  # the precision it measured, not the one it asked for
        assert any("float64 evaluations are quantised" in note for note in report.notes), report.notes


def _wide_linear_window() -> tuple[nn.Module, Any, Callable[[nn.Module, Any], torch.Tensor]]:
    """A linear layer whose float32 gradient (a mean over 4,096 samples of large cancelling terms) is off the float64
    one by about 1e-6 of its norm: far beyond float32's storage rounding, the float32 accumulation's own rounding."""
    torch.manual_seed(0)
    batch = (torch.randn(4096, 8), torch.randn(4096, 16) * 1e3)
    model = nn.Linear(8, 16)

    def loss_fn(module: nn.Module, b: Any) -> torch.Tensor:
        out = module(b[0])
        return (out * b[1]).mean() + 1e-3 * (out**2).mean()

    return model, batch, loss_fn


@pytest.mark.parametrize("factor", [1.0, 1.03])
def test_a_tf32_setting_a_cpu_path_ignores_keeps_the_float32_accumulation_in_the_applied_floor(factor: float) -> None:
    """The TF32 floor is the distance of training's gradient from IEEE float32's; where the device ignores the setting
    (or rounds only a little differently, as oneDNN's convolutions on some CPUs) that distance is below the float32
    backward's own rounding, which must stay in the floor: a correct gradient passes (it failed at 2e-7 of ‖g‖ against a
    floor of 6e-8), a 3% wrong one still fails."""
    model, batch, loss_fn = _wide_linear_window()
    model.zero_grad()
    loss_fn(model, batch).backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
    gradients["weight"] *= factor
    saved = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        report = check_applied_gradient(model, [batch], loss_fn, gradients, step=1, combine="mean")
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved
    assert any("TF32" in str(note) for note in report.notes)
    assert report.verdict == ("ok" if factor == 1.0 else "fail"), report.summary()
