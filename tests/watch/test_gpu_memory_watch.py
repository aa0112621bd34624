"""A watch on a device short of memory (emulated: :mod:`tests.gpu_emulation`): training goes on bit for bit, no check
fails falsely or is skipped, and the checks keep running in a precision the device can afford."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from gradwatch import GradientWatch
from gradwatch.engine.function import memory
from gradwatch.engine.results.notes import NoteCode
from gradwatch.watch.lessons import Float64Backoff
from tests.gpu_emulation import Float64MemoryLimit, LimitedDevice, SlowFloat64


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def _run(limit: Float64MemoryLimit | None, steps: int = 6) -> tuple[nn.Module, GradientWatch | None]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 6))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    watch = None if limit is None else GradientWatch(every_n_steps=1, applied_every_n_steps=2, max_overhead=None)
    for step in range(1, steps + 1):
        batch = torch.randn(16, 24, generator=generator), torch.randn(16, 6, generator=generator)
        if watch is not None:
            watch.record(batch)
        _loss(model, batch).backward()
        if watch is not None and limit is not None:
            with limit:
                watch.before_optimizer_step(model, _loss, step=step)
        optimizer.step()
        optimizer.zero_grad()
        if watch is not None and limit is not None:
            with limit:
                watch.maybe_check(model, batch, _loss, step=step)
    return model, watch


PLAIN = {steps: _run(None, steps)[0] for steps in (3, 6)}


def _same(model: nn.Module, steps: int) -> bool:
    plain = PLAIN[steps].parameters()
    return all(torch.equal(a, b) for a, b in zip(plain, model.parameters(), strict=True))


@pytest.mark.slow
def test_every_float64_tensor_above_a_few_thousand_elements_refused():
    limit = Float64MemoryLimit(above=1000)
    model, watch = _run(limit)
    assert watch is not None
    assert limit.raised > 0
    assert _same(model, 6)
    assert watch.counts["skipped"] == 0
    assert watch.counts["failed"] == 0
    assert watch.counts["applied_failed"] == 0
    recomputed = watch.recomputed_reports
    assert len(recomputed) == 6
    assert sum(r.verdict == "ok" for r in recomputed) >= 3, [r.summary() for r in recomputed]
    assert all(r.precision == "native" for r in recomputed if r.verdict == "ok")  # what the device affords
    applied = watch.applied_reports
    assert [r.step for r in applied] == [1, 2, 4, 6]
    assert all(r.verdict == "ok" for r in applied), [r.summary() for r in applied]  # probed natively instead
    assert all(r.noted("memory-native") and r.precision == "native" for r in applied)  # what the probes computed in
    state = watch.state_dict()  # checks 1 and 6 tried float64; 2 and 4 were kept native by the back-off
    assert (state["applied_float64_misses"], state["applied_float64_native_left"]) == (2, 4)
    for report in watch.reports:  # an undecided check says why
        if report.verdict == "inconclusive":
            assert any(note.code == NoteCode.OUT_OF_MEMORY for note in report.notes), report.notes


@pytest.mark.parametrize("at", [1, 20, 60, 120, 200, 300])
def test_one_out_of_memory_error_anywhere_in_a_run(at: int):
    limit = Float64MemoryLimit(at=at)
    model, watch = _run(limit, steps=3)
    assert watch is not None
    assert _same(model, 3)
    assert watch.counts["failed"] == 0
    assert watch.counts["applied_failed"] == 0
    assert watch.counts["skipped"] == 0
    reports = watch.recomputed_reports
    assert reports[-1].verdict == "ok", [r.summary() for r in reports]  # the next check runs
    assert [r.verdict for r in watch.applied_reports] == ["ok", "ok"], [r.summary() for r in watch.applied_reports]
    for report in reports:
        if report.verdict == "inconclusive":
            assert any(note.code == NoteCode.OUT_OF_MEMORY for note in report.notes), report.notes


def _applied_run(limit: Float64MemoryLimit, steps: int, watch: GradientWatch) -> tuple[nn.Module, list[int]]:
    """Applied checks only, at every step: the model, and how many float64 tensors each check was refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 6))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    refused = []
    for step in range(1, steps + 1):
        batch = torch.randn(16, 24, generator=generator), torch.randn(16, 6, generator=generator)
        watch.record(batch)
        _loss(model, batch).backward()
        before = limit.raised
        with limit:
            watch.before_optimizer_step(model, _loss, step=step)
        refused.append(limit.raised - before)
        optimizer.step()
        optimizer.zero_grad()
    return model, refused


def _applied_watch() -> GradientWatch:
    return GradientWatch(every_n_steps=10**6, first_check_step=None, applied_every_n_steps=1, max_overhead=None,
                         check_update=False)  # fmt: skip


@pytest.mark.slow
def test_applied_checks_do_not_try_float64_again_in_vain_after_it_ran_out_of_memory():
    limit = Float64MemoryLimit(above=1000)
    watch = _applied_watch()
    model, refused = _applied_run(limit, 9, watch)
    plain = _run(None, 9)[0]
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters(), strict=True))
    applied = watch.applied_reports
    assert [r.verdict for r in applied] == ["ok"] * 9, [r.summary() for r in applied]
    assert all(r.precision == "native" and r.noted(NoteCode.MEMORY_NATIVE) for r in applied)
    # float64 probes tried at checks 1, 4 (after 2 kept native) and 9 (after 4): each tried check is refused its
    # float64 probes and the clip check's float64 norms, a check kept native only the norms (a guarded call)
    tried = [i + 1 for i, n in enumerate(refused) if n > 1]
    assert tried == [1, 4, 9], refused
    state = watch.state_dict()
    assert (state["applied_float64_misses"], state["applied_float64_native_left"]) == (3, 8)
    resumed = _applied_watch()
    resumed.load_state_dict(state)  # a resumed run keeps the lesson
    assert not resumed._lessons.float64.allows(model)


def test_the_float64_back_off_recovers_when_float64_fits_or_free_memory_doubles():
    backoff = Float64Backoff()
    model = nn.Linear(3, 2)
    free = [1000]
    previous = memory.set_free_memory_probe(lambda device: free[0])
    try:
        missed = _report(precision="native", code=NoteCode.MEMORY_NATIVE)
        assert backoff.allows(model)
        assert not backoff.learn(missed)
        assert not backoff.allows(model)
        assert backoff.learn(missed)  # a check kept native: noted as such, not counted as a miss
        assert not backoff.allows(model)
        backoff.learn(missed)
        assert backoff.allows(model)  # 2 checks kept native after the first miss: float64 tried again
        backoff.learn(missed)
        assert (backoff.misses, backoff.left) == (2, 4)
        assert not backoff.allows(model)
        backoff.learn(missed)
        free[0] = 2000  # twice the free memory of the miss: tried again at once
        assert backoff.allows(model)
        backoff.learn(_report(precision="float64", code=None))
        assert (backoff.misses, backoff.left) == (0, 0)
        assert backoff.allows(model)
    finally:
        memory.set_free_memory_probe(previous)


def _report(precision: str, code: NoteCode | None):
    from gradwatch.engine.results.kinds import Verdict
    from gradwatch.engine.results.notes import Note
    from gradwatch.engine.results.report import CheckReport

    notes = [Note(code, "probes run natively")] if code is not None else []
    return CheckReport(step=1, verdict=Verdict.OK, probes=[], loss=1.0, n_forward=0, n_backward=0, duration_s=0.0,
                       notes=notes, precision=precision, scope="applied")  # fmt: skip


def _adam_run(device: LimitedDevice, slow: SlowFloat64 | None, watch: GradientWatch | None) -> nn.Module:
    """Four steps of Adam on batches of 128 (activations outweigh the parameters, as in a fine-tune sized to the card),
    the model and its optimizer state made on the emulated device, both kinds of check at every step."""
    with device:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 6))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    for step in range(1, 5):
        batch = torch.randn(128, 24, generator=generator), torch.randn(128, 6, generator=generator)
        with device, slow or contextlib.nullcontext():
            if watch is not None:
                watch.record(batch)
            _loss(model, batch).backward()
            if watch is not None:
                watch.before_optimizer_step(model, _loss, step=step)
            optimizer.step()
            optimizer.zero_grad()
            if watch is not None:
                watch.maybe_check(model, batch, _loss, step=step)
    return model


@pytest.mark.slow
def test_a_device_with_a_tenth_more_than_the_steps_peak_and_float64_a_hundred_times_slower():
    measuring = LimitedDevice()
    plain = _adam_run(measuring, None, None)
    tight = LimitedDevice(limit=int(1.1 * measuring.peak))
    torch.manual_seed(0)
    with LimitedDevice():  # priced under the device's bookkeeping, which slows native and float64 passes alike
        slow = SlowFloat64.calibrated(nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 6)),
                                      (torch.randn(128, 24), torch.randn(128, 6)), _loss, 100)  # fmt: skip
    watch = GradientWatch(every_n_steps=1, applied_every_n_steps=1, max_overhead=None)
    model = _adam_run(tight, slow, watch)  # none raises
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters(), strict=True))
    assert watch.notes == []  # no call of the watch ran out of memory
    counts = watch.counts
    assert (counts["skipped"], counts["failed"], counts["applied_failed"], counts["update_failed"]) == (0, 0, 0, 0)
    assert (counts["checks"], counts["applied_checks"]) == (4, 4)
    said = (NoteCode.MEMORY_POSTPONED, NoteCode.OUT_OF_MEMORY)
    for report in watch.reports:  # completed, or postponed with a note saying why
        assert report.verdict == "ok" or any(report.noted(code) for code in said), report.summary()
    recomputed = watch.recomputed_reports
    assert sum(r.verdict == "ok" for r in recomputed) >= 3, [r.summary() for r in recomputed]
    assert all(r.precision == "native" for r in recomputed if r.verdict == "ok")  # float64 affordable in neither
    # the first applied check ran out of memory; the later ones were postponed before they started, not run out
    assert not any(r.noted(NoteCode.OUT_OF_MEMORY) for r in watch.applied_reports[1:])
