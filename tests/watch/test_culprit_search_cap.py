"""A watch's failing checks with their culprit search capped (``max_culprit_search_steps``): a deep model's bug is
localised over a few bounded checks, each going on where the last stopped, through a checkpoint too; a healthy run
carries nothing. The cap is spent on a clock that counts its readings (``Lessons.search_clock``), never wall time."""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import pytest
import torch
from culprit_models import Stack

from gradwatch import GradientCheckWarning, GradientWatch, check_gradients
from gradwatch.engine.probing.search_budget import SearchBudget
from gradwatch.engine.results.notes import NoteCode

PLANTED = "blocks.6.act"


class Readings:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=generator), torch.randint(0, 3, (6,), generator=generator))
            for _ in range(count)]  # fmt: skip


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


def _watch(**options: Any) -> GradientWatch:
    watch = GradientWatch(every_n_steps=1, applied_every_n_steps=None, max_overhead=None, verbose=False,
                          precision="float64", **options)  # fmt: skip
    # one second a reading: a cap of one training step (milliseconds) is spent at the first, the search then stops as
    # soon as it narrowed the culprit (deterministic, whatever the machine's load)
    watch._lessons.search_clock = Readings()
    watch._lessons.search_min_seconds = 0.0
    return watch


def _train(watch: GradientWatch, model: torch.nn.Module, steps: int, first: int = 1) -> list[str]:
    """A plain loop with the watch; the alerts it raised, in words."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, batch in enumerate(_batches(steps), start=first):
            _loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            watch.maybe_check(model, batch, _loss, step=step)
    return [str(w.message) for w in caught if issubclass(w.category, GradientCheckWarning)]


@pytest.mark.slow
def test_a_tiny_cap_localises_a_deep_bug_over_a_few_bounded_checks() -> None:
    watch = _watch(max_culprit_search_steps=1)
    model = Stack(depth=8, bug_at=6)
    alerts = _train(watch, model, steps=8)
    reports = watch.recomputed_reports
    assert all(r.verdict == "fail" for r in reports)  # the gradient is wrong at every check, the search or not
    first = reports[0]
    assert not first.culprit_search.complete
    assert first.noted(NoteCode.CULPRIT_SEARCH_CAPPED)
    assert "stopped" in first.culprit_message
    assert "candidate" in first.culprit_message
    assert first.culprit_message in alerts[0]  # the alert says the search stopped, and where
    named = next(i for i, r in enumerate(reports) if r.culprits and r.culprits[0] == PLANTED)
    assert 0 < named < len(reports) - 1
    assert all(r.culprit_search.resumed for r in reports[1 : named + 1])  # each went on from the last
    uncapped = _watch(max_culprit_search_steps=None)
    _train(uncapped, Stack(depth=8, bug_at=6), steps=1)
    assert uncapped.recomputed_reports[0].culprits == reports[named].culprits
    assert first.culprit_search.evaluations < uncapped.recomputed_reports[0].culprit_search.evaluations


@pytest.mark.slow
def test_the_search_goes_on_from_a_checkpoint() -> None:
    watch = _watch(max_culprit_search_steps=1)
    model = Stack(depth=8, bug_at=6)
    _train(watch, model, steps=2)
    state = watch.state_dict()
    assert state["culprit_search_within"] == list(watch.recomputed_reports[-1].culprit_search.within)
    assert state["culprit_search_candidates"] == list(watch.recomputed_reports[-1].culprit_search.candidates)
    resumed = _watch(max_culprit_search_steps=1)
    resumed.load_state_dict(state)
    assert resumed.state_dict()["culprit_search_within"] == state["culprit_search_within"]
    _train(resumed, model, steps=1, first=3)
    search = resumed.recomputed_reports[0].culprit_search
    assert search.resumed
    assert len(search.within) >= len(state["culprit_search_within"])


def test_a_healthy_run_carries_no_search() -> None:
    watch = _watch(max_culprit_search_steps=1)
    model = Stack(depth=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step, batch in enumerate(_batches(2), start=1):
        _loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        watch.maybe_check(model, batch, _loss, step=step)
    assert [r.verdict for r in watch.recomputed_reports] == ["ok", "ok"]
    assert all(r.culprit_search is None for r in watch.recomputed_reports)
    assert watch.state_dict()["culprit_search_within"] == []
    GradientWatch().load_state_dict({"version": 1})  # an older checkpoint, without the keys, loads


@pytest.mark.parametrize("value", [0, -5, 2.5, True, "100"], ids=["zero", "negative", "float", "bool", "string"])
def test_the_cap_is_validated(value: Any) -> None:
    with pytest.raises(ValueError, match="`max_culprit_search_steps` must be None or an integer >= 1"):
        GradientWatch(max_culprit_search_steps=value)


SLEEP = 0.02
"""Seconds a loss sleeps per sample while autograd records (a reference pass, never a probe): a lower bound on what
a forward and backward of a batch takes, whatever the machine's load."""


def _sleepy_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    if torch.is_grad_enabled():
        time.sleep(SLEEP * len(batch[0]))
    return _loss(model, batch)


def test_before_a_step_is_timed_the_cap_stands_in_the_whole_batch_for_the_probe_slice() -> None:
    # a probe slice of 2 samples out of 6: its reference pass is a third of the batch's forward and backward
    budget = SearchBudget(steps=1)
    model = Stack(depth=2, bug_at=None)
    check_gradients(model, _batches(1)[0], _sleepy_loss, probe_batch_size=2, search_budget=budget)
    assert budget.step_seconds is not None
    assert budget.step_seconds >= 6 * SLEEP  # the slice's 2 x SLEEP alone would be a third of a step


def test_at_the_first_step_an_applied_checks_window_stands_in_for_a_training_step() -> None:
    # the run's step time is unknown at its first optimizer step (the time before the first batch is not training);
    # under accumulation a recomputed check's reference pass covers one micro-batch of the step, the applied check's
    # window all four
    watch = GradientWatch(every_n_steps=1, applied_every_n_steps=1, max_overhead=None, verbose=False,
                          check_update=False)  # fmt: skip
    model = Stack(depth=2, bug_at=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch.start()
    batches = _batches(4)
    for batch in batches:
        watch.record(batch, model=model, step=1)
        (_loss(model, batch) / len(batches)).backward()
    assert watch._lessons.step_stand_in is None
    report = watch.before_optimizer_step(model, _sleepy_loss, step=1, optimizer=optimizer)
    assert report is not None
    assert report.verdict == "ok"
    assert watch._lessons.step_stand_in is not None
    assert watch._lessons.step_stand_in >= 4 * 6 * SLEEP  # the window's four micro-batches
    assert watch._search_budget().step_seconds == watch._lessons.step_stand_in
    optimizer.step()
    watch._clock.batch_ended(time.perf_counter() + 1.0)  # a step timed: the run's own step time wins
    watch._recomputed.steps = 1
    assert watch._search_budget().step_seconds != watch._lessons.step_stand_in


def test_lessons_keep_a_step_stand_in_only_when_one_was_measured() -> None:
    lessons = GradientWatch(verbose=False)._lessons
    lessons.learn_step(SearchBudget(steps=100))  # nothing measured
    assert lessons.step_stand_in is None
    assert lessons.search_budget(100, math.nan).step_seconds is None
    lessons.learn_step(SearchBudget(steps=100, step_seconds=2.5))
    assert lessons.search_budget(100, math.nan).step_seconds == 2.5
    assert lessons.search_budget(100, 0.5).step_seconds == 0.5
