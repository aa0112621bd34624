"""A watch's failing checks with their culprit search capped (``max_culprit_search_steps``): a deep model's bug is
localised over a few bounded checks, each going on where the last stopped, through a checkpoint too; a healthy run
carries nothing. The cap is spent on a clock that counts its readings (``Lessons.search_clock``), never wall time."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from culprit_models import Stack

from gradwatch import GradientCheckWarning, GradientWatch
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
