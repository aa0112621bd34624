"""A check on a device short of memory (emulated on the CPU: :mod:`tests.gpu_emulation`): an out-of-memory error at
any float64 allocation of a check ends the check, never the run, leaves the model exactly as it was and the next check
runs; float64 that would not fit in the device's free memory is not tried; float64 that costs too much against the
native step on the device gives way to native probes, with a note."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradwatch import CheckReport, check_applied_gradient, check_gradients
from gradwatch.engine.function import memory
from gradwatch.engine.results.notes import NoteCode
from tests.gpu_emulation import Float64MemoryLimit, LimitedDevice, SlowFloat64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 6))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 24, generator=generator), torch.randn(16, 6, generator=generator)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.parameters()] + [
        p.grad.clone() for p in model.parameters() if p.grad is not None
    ]


def _float64_allocations() -> int:
    model = _model()
    _loss(model, _batch()).backward()
    with Float64MemoryLimit(at=None, above=1 << 62) as counting:  # float64 pinned: "auto" prices it by the clock
        check_gradients(model, _batch(), _loss, probe_batch_size=4, precision="float64")
    return counting.made


ALLOCATIONS = _float64_allocations()


@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.15, 0.3, 0.5, 0.7, 0.9, 0.99])
def test_out_of_memory_at_any_phase_of_a_check_leaves_the_model_exactly_and_the_next_check_runs(fraction: float):
    model = _model()
    _loss(model, _batch()).backward()
    before = _state(model)
    at = 1 + int(fraction * (ALLOCATIONS - 1))
    with Float64MemoryLimit(at=at) as limit:
        report = check_gradients(model, _batch(), _loss, probe_batch_size=4, precision="float64")
    assert limit.raised == 1
    assert report.verdict != "fail", report.summary()
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model), strict=True))
    if report.verdict == "inconclusive":
        assert any(note.code in (NoteCode.OUT_OF_MEMORY, NoteCode.MEMORY_NATIVE) for note in report.notes)
    after = check_gradients(model, _batch(), _loss, probe_batch_size=4)
    assert after.verdict == "ok"


def test_the_cpu_allocators_error_is_an_out_of_memory_error_too():
    class CpuAllocatorLimit(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float64 and out.numel() > 100:
                raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory")
            return out

    model = _model()
    before = _state(model)
    with CpuAllocatorLimit():
        report = check_gradients(model, _batch(), _loss, probe_batch_size=4)
    assert report.verdict == "ok"
    assert report.precision == "native"
    assert [n for n in report.notes if n.code == NoteCode.MEMORY_NATIVE], report.notes
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model), strict=True))


def test_float64_that_would_not_fit_in_the_free_memory_is_not_tried():
    model = _model()
    previous = memory.set_free_memory_probe(lambda device: 18000)  # bytes: the native check fits, float64 not
    try:
        with Float64MemoryLimit(above=1 << 62) as counting:
            report = check_gradients(model, _batch(), _loss, probe_batch_size=4)
    finally:
        memory.set_free_memory_probe(previous)
    assert report.verdict == "ok"
    assert report.precision == "native"
    (note,) = [n for n in report.notes if n.code == NoteCode.MEMORY_NATIVE]
    assert "float64 probes need about" in note
    assert "17.6 KiB free on the device" in note
    assert counting.largest < max(p.numel() for p in model.parameters())  # no float64 copy of a weight made


def test_the_estimate_counts_float64_copies_and_activations():
    params = [torch.zeros(10, 10), torch.zeros(5)]
    estimate = memory.check_peak(params, [], [torch.zeros(4, 3)], 1000, 4, torch.device("cpu"))
    assert estimate.float64 == 8 * (105 + 12) + 8 * 1000
    assert estimate.native == 4 * 1000 + 2 * 100 * 4
    assert estimate.free is None
    assert estimate.fits("float64")


@pytest.mark.slow
def test_float64_a_hundred_times_slower_gives_way_to_native_probes_once_measured():
    model = _model()
    with SlowFloat64.calibrated(model, _batch(), _loss, 100):
        first = check_gradients(model, _batch(), _loss, probe_batch_size=4)
        second = check_gradients(model, _batch(), _loss, probe_batch_size=4)
    for report in (first, second):
        assert report.verdict == "ok"
        assert report.precision == "native"
        (note,) = [n for n in report.notes if n.code == NoteCode.FLOAT64_TOO_SLOW]
        assert "x a native forward and backward on this device" in note
    assert first.notes == second.notes
    assert first.n_forward - second.n_forward >= 2  # the second did not time a native and a float64 evaluation again
    assert check_gradients(_model(), _batch(), _loss, probe_batch_size=4).precision == "float64"  # not this device


@pytest.mark.slow
def test_explicit_float64_is_not_priced():
    with SlowFloat64.calibrated(_model(), _batch(), _loss, 100):
        report = check_gradients(
            _model(), _batch(), _loss, probe_batch_size=4, precision="float64", tensor_probes=1, random_probes=0,
            param_probes=0, input_probes=0,
        )  # fmt: skip
    assert report.precision == "float64"


@pytest.mark.slow
def test_a_device_with_little_more_than_the_steps_peak_free_and_slow_float64():
    def train(device: LimitedDevice | None, slow: SlowFloat64 | None) -> tuple[nn.Module, list]:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        reports = []
        for step in range(1, 4):
            with device or contextlib.nullcontext(), slow or contextlib.nullcontext():
                loss = _loss(model, _batch())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if device is not None:
                    reports.append(check_gradients(model, _batch(), _loss, probe_batch_size=4, step=step))
        return model, reports

    measuring = LimitedDevice()
    plain, _ = train(measuring, slow=None)
    tight = LimitedDevice(limit=int(1.1 * measuring.peak))
    with LimitedDevice():  # priced under the device's bookkeeping, which slows native and float64 passes alike
        slow = SlowFloat64.calibrated(_model(), _batch(), _loss, 100)
    model, reports = train(tight, slow=slow)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters(), strict=True))
    assert len(reports) == 3
    assert all(r.verdict != "fail" for r in reports)
    assert all(r.verdict == "ok" or r.notes for r in reports)
    assert sum(r.verdict == "ok" for r in reports) >= 2, [r.summary() for r in reports]
    assert all(r.precision == "native" for r in reports)  # float64 is priced out on this device


def test_a_probe_batch_that_would_not_fit_is_shrunk_before_the_check_or_the_check_postponed():
    model = _model()
    _loss(model, _batch()).backward()
    before = _state(model)
    check_gradients(model, _batch(), _loss, probe_batch_size=4)  # measures the model's activations per sample
    per_sample = memory._PER_SAMPLE[model]
    assert 0 < per_sample < 4 * (24 + 48 + 48 + 6 + 6)  # float32 activations of a sample, not the weights' views
    fixed = 2 * 4 * sum(p.numel() for p in model.parameters())  # the copy of the parameters and their gradient
    for free, samples in [((fixed + 1.5 * per_sample) / memory.HEADROOM, 1), (0.9 * fixed / memory.HEADROOM, 0)]:
        previous = memory.set_free_memory_probe(lambda device, free=free: int(free))
        try:
            with Float64MemoryLimit(above=1 << 62) as counting:
                report = check_gradients(model, _batch(), _loss, probe_batch_size=4)
        finally:
            memory.set_free_memory_probe(previous)
        assert all(torch.equal(a, b) for a, b in zip(before, _state(model), strict=True))
        if samples:
            assert report.verdict == "ok", report.summary()
            assert report.samples == 1
            assert report.noted(NoteCode.MEMORY_SHRUNK)
        else:  # not even one sample fits: postponed before anything is allocated
            assert report.verdict == "inconclusive"
            assert report.noted(NoteCode.MEMORY_POSTPONED)
            assert counting.made == 0
            assert not report.probes


def _applied(model: nn.Module) -> CheckReport:
    return check_applied_gradient(model, [_batch()], _loss)


def _applied_float64_allocations() -> int:
    model = _model()
    _loss(model, _batch()).backward()
    with Float64MemoryLimit(at=None, above=1 << 62) as counting:
        _applied(model)
    return counting.made


APPLIED_ALLOCATIONS = _applied_float64_allocations()


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99])
def test_out_of_memory_at_any_phase_of_an_applied_check_leaves_the_model_exactly_and_the_next_check_runs(
    fraction: float,
):
    model = _model()
    _loss(model, _batch()).backward()
    before = _state(model)
    grads = [p.grad for p in model.parameters()]
    with Float64MemoryLimit(at=1 + int(fraction * (APPLIED_ALLOCATIONS - 1))) as limit:
        report = _applied(model)
    assert limit.raised == 1
    assert report.verdict != "fail", report.summary()
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model), strict=True))
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))  # the very tensors
    if report.verdict == "inconclusive":
        assert report.noted(NoteCode.OUT_OF_MEMORY) or report.noted(NoteCode.MEMORY_NATIVE), report.notes
    assert _applied(model).verdict == "ok"
