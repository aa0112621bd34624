"""A watch on a device short of memory (emulated: :mod:`tests.gpu_emulation`): training goes on bit for bit, no check
fails falsely or is skipped, and the checks keep running in a precision the device can afford."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradwatch import GradientWatch
from gradwatch.engine.results.notes import NoteCode
from tests.gpu_emulation import Float64MemoryLimit


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
    assert sum(r.verdict == "ok" for r in recomputed) >= 5, [r.summary() for r in recomputed]
    assert all(r.precision == "native" for r in recomputed if r.verdict == "ok")  # what the device affords
    applied = watch.applied_reports
    assert [r.step for r in applied] == [1, 2, 4, 6]
    assert all(r.verdict == "ok" for r in applied), [r.summary() for r in applied]  # probed natively instead
    assert all(r.noted("applied-native") for r in applied)
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
