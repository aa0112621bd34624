"""The first checks of a run as a bounded one-time cost: the first applied check leaves its closer look for a later
check when its combined probes agree (``engine/applied/probes.py``), and the watch owes that check, made as soon
as the budget affords it (``Cadence.owe``), through a checkpoint too. Decided on a fake clock (training time set by
the loop, a check's time by its loss evaluations) so that every step asserted is deterministic."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from applied_models import CNN, batch_for, cross_entropy
from torch import nn

import gradwatch.watch.updates
import gradwatch.watch.watch
from gradwatch import GradientWatch
from gradwatch.engine.applied.probes import deferred
from gradwatch.watch.applied import Windows
from gradwatch.watch.cadence import APPLIED_KEYS, Cadence
from gradwatch.watch.overhead import OverheadClock

STEP_SECONDS, EVALUATION_SECONDS = 1.0, 0.01
"""The fake clock: a training step takes 1 s besides its loss evaluation, each loss evaluation 0.01 s."""


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    for module in (gradwatch.watch.watch, gradwatch.watch.updates):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def _loop(watch: GradientWatch, clock: _Clock, steps: int, fault: tuple[str, float] | None = None) -> None:
    """A plain loop over the CNN's batches (one micro-batch per step, SGD), ``fault`` scaling a tensor's gradient at
    every backward."""
    torch.manual_seed(0)
    model = CNN()
    if fault is not None:
        dict(model.named_parameters())[fault[0]].register_hook(lambda g: g * fault[1])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        clock.now += EVALUATION_SECONDS
        return cross_entropy(model, batch)

    for step in range(1, steps + 1):
        batch = batch_for(model, size=64, seed=step)
        watch.record(batch)
        loss_fn(model, batch).backward()
        clock.now += STEP_SECONDS
        watch.before_optimizer_step(model, loss_fn, step=step)
        optimizer.step()
        optimizer.zero_grad()
        watch.maybe_check(model, batch, loss_fn, step=step)


def _watch(**options: Any) -> GradientWatch:
    return GradientWatch(every_n_steps=10_000, verbose=False, check_update=False, **options)


def test_the_first_applied_check_owes_its_closer_look_and_the_budget_decides_when(clock: _Clock) -> None:
    watch = _watch(max_overhead=0.02)
    _loop(watch, clock, 60)
    first, owed = watch.applied_reports
    assert first.step == 1
    assert first.verdict == "ok"
    assert deferred(first.notes)
    assert owed.verdict == "ok"
    assert not deferred(owed.notes)
    # a full check (it makes its closer look where its own probes call for one: at step 16 they are calm)
    # made at the first step whose training time affords it: every check so far, and the last applied check's cost
    # again, within 2% of the training time (training time counted from the end of step 1)
    spent = watch._clock.check_seconds + watch._clock.applied_seconds
    assert watch._clock.train_seconds >= (spent - owed.duration_s) / 0.02 - 2 * STEP_SECONDS
    assert 1 < owed.step < 60


def test_without_a_budget_the_first_applied_check_is_made_in_full(clock: _Clock) -> None:
    watch = _watch(max_overhead=None, applied_every_n_steps=10_000)
    _loop(watch, clock, 3)
    (first,) = watch.applied_reports
    assert first.step == 1
    assert first.verdict == "ok"
    assert not deferred(first.notes)


def test_without_its_closer_look_owed_no_second_applied_check_comes_before_its_cadence(clock: _Clock) -> None:
    watch = _watch(max_overhead=0.02)
    _loop(watch, clock, 1)
    assert deferred(watch.applied_reports[0].notes)
    watch._applied.pending = False  # as if nothing were owed
    _loop_from(watch, clock, 2, 60)
    assert len(watch.applied_reports) == 1


def _loop_from(watch: GradientWatch, clock: _Clock, first: int, last: int) -> None:
    """Steps ``first..last`` of :func:`_loop`'s run (its model trained anew: only the cadence is asserted)."""
    torch.manual_seed(0)
    model = CNN()

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        clock.now += EVALUATION_SECONDS
        return cross_entropy(model, batch)

    watch.start(first - 1)
    for step in range(first, last + 1):
        batch = batch_for(model, size=64, seed=step)
        watch.record(batch)
        loss_fn(model, batch).backward()
        clock.now += STEP_SECONDS
        watch.before_optimizer_step(model, loss_fn, step=step)
        model.zero_grad()
        watch.maybe_check(model, batch, loss_fn, step=step)


def test_a_real_fault_is_still_caught_at_step_1(clock: _Clock) -> None:
    watch = _watch(on_fail=lambda report: None)
    _loop(watch, clock, 1, fault=("fc.weight", 1.003))
    (first,) = watch.applied_reports
    assert first.step == 1
    assert first.verdict == "fail"
    assert "fc.weight" in first.failed_tensors
    assert not deferred(first.notes)


def _windows(budget: float) -> Windows:
    return Windows(Cadence("applied", 5000, 1, budget, OverheadClock(), keys=APPLIED_KEYS))


def _train(windows: Windows, steps: range, check_seconds: float, owe: bool) -> list[int]:
    """The applied cadence over ``steps`` on a fake clock (1 s a step, ``check_seconds`` a check): the steps checked,
    the first check owing its closer look when ``owe``."""
    checked, cadence = [], windows.cadence
    for step in steps:
        if windows.begin(step, lambda wait: wait):
            windows.record(object(), None)
        cadence.clock.batch_ended(step + check_seconds * cadence.checks)  # the time so far: steps and checks
        if windows.take(step) is not None:
            checked.append(step)
            cadence.clock.add_check(check_seconds)
            cadence.ran(check_seconds)
            if owe and cadence.checks == 1:
                cadence.owe()
    return checked


def test_an_owed_check_is_made_when_the_budget_affords_it_and_survives_a_checkpoint() -> None:
    uninterrupted = _windows(0.01)
    assert uninterrupted.cadence.unbounded  # the first check: no budget bounds it, its closer look waits
    first, owed = _train(uninterrupted, range(1, 700), 3.0, owe=True)
    # the first check costs 3 s; the owed one is made once the training time affords both: (3 + 3) / 1% = 600 s
    assert first == 1
    assert 600 <= owed <= 605
    assert uninterrupted.cadence.clock.fraction <= 0.01
    windows = _windows(0.01)
    assert _train(windows, range(1, 300), 3.0, owe=True) == [1]
    assert not windows.cadence.unbounded
    state = windows.cadence.state_dict()
    assert state["applied_pending"] is True
    resumed = _windows(0.01)
    resumed.cadence.load_state_dict(state)
    resumed.cadence.clock.load_state_dict(windows.cadence.clock.state_dict())
    resumed.cadence.clock.batch_ended(299.0 + 3.0)
    resumed.step = 299  # the watch's windows go on from the step the checkpoint was taken at
    assert _train(resumed, range(300, 700), 3.0, owe=True) == [owed]


def test_a_first_check_that_owes_nothing_waits_for_its_cadence() -> None:
    assert _train(_windows(0.01), range(1, 5002), 3.0, owe=False) == [1, 5000]


def test_no_gradient_is_kept_for_an_owed_check_before_its_postponement_ends() -> None:
    windows = _windows(0.01)
    _train(windows, range(1, 10), 3.0, owe=True)
    assert windows.cadence.pending
    assert windows.cadence.resume_at > 10
    assert not windows.due(10, 9)  # the watch keeps no copy of the gradient for the step before a check not yet due
    assert windows.due(windows.cadence.resume_at, windows.cadence.resume_at - 1)


def test_the_update_check_of_the_first_applied_check_is_part_of_the_one_time_cost() -> None:
    clock = OverheadClock()
    clock.batch_ended(0.0)
    clock.add_check(2.0)  # the first applied check
    clock.add_check(0.25, first=True)  # the update check it leads to
    clock.batch_ended(3.25)
    clock.add_check(0.5)  # a later applied check
    assert clock.first_seconds == 2.25
    assert clock.steady_fraction == 0.5
