"""Nothing a watch runs outside a check ends a run (:mod:`gradwatch.watch.guard`): an error injected at each call
gradwatch makes around the checks of a plain loop (recording and its float64 checksums, the clip check's norms, the
schedule and budget, the state, the sinks, the lessons, the remarks and alerts) is reported once, as a note and a
warning, and the run trains bit for bit as without gradwatch; what must still propagate does (a failing check under
``on_fail="raise"``, ``KeyboardInterrupt``, the user's own loss under ``on_fail="raise"``, bad arguments)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from loop_models import MLP, assert_same_state, classification_batches, cross_entropy, plant_bug, state_of

import gradwatch.engine.applied.clipping as clipping
import gradwatch.engine.applied.window as window
import gradwatch.outputs.sinks as sinks
import gradwatch.watch.alerts as alerts
import gradwatch.watch.applied as applied
import gradwatch.watch.cadence as cadence
import gradwatch.watch.lessons as lessons
import gradwatch.watch.outcomes as outcomes
import gradwatch.watch.overhead as overhead
import gradwatch.watch.watch as watch_module
from gradwatch import GradientCheckError, GradientWatch
from gradwatch.engine.results.notes import NoteCode

MAX_NORM = 0.5

SITES: list[tuple[Any, str]] = [
    (applied.Windows, "begin"),
    (applied.Windows, "record"),
    (applied.Windows, "idle"),  # before_optimizer_step's test of a step with nothing to do
    (applied.Windows, "take"),
    (window.Checksums, "of"),  # watch.record's float64 checksums
    (window, "capture_rng"),
    (clipping.GradientNorms, "of"),  # the clip coefficient's bookkeeping
    (cadence.Cadence, "reached"),
    (cadence.Cadence, "runs_now"),
    (cadence.Cadence, "ran"),
    (cadence.Cadence, "due"),
    (cadence.Cadence, "start"),
    (cadence.Cadence, "state_dict"),
    (cadence.Cadence, "load_state_dict"),
    (overhead.OverheadClock, "batch_ended"),
    (overhead.OverheadClock, "state_dict"),
    (lessons.Lessons, "checkable"),
    (lessons.Lessons, "set_up"),
    (lessons.Lessons, "learn"),
    (alerts.Remarks, "hear"),
    (alerts.AlertPolicy, "handle"),
    (outcomes, "report_records"),
    (sinks.JsonLinesSink, "write"),
    (sinks.JsonLinesSink, "flush"),
    (outcomes.Outcomes, "state_dict"),
    (outcomes.Outcomes, "load_state_dict"),
    (watch_module, "default_group"),
    (watch_module, "is_sharded"),
]


def _site_id(site: tuple[Any, str]) -> str:
    owner, name = site
    return f"{getattr(owner, '__name__', owner)}.{name}"


class InjectedError(RuntimeError):
    """The error planted at a call site."""


def _inject(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, error: BaseException) -> list[int]:
    """Make ``owner.name`` raise ``error`` at every call; the returned list counts the calls."""
    calls: list[int] = []

    def raising(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise error

    monkeypatch.setattr(owner, name, raising)
    return calls


def _train(watch: GradientWatch | None, steps: int = 4, bug: bool = False, loss: Any = cross_entropy) -> dict[str, Any]:
    """A plain loop calling every method of the watch: setup and start, record, before_optimizer_step, the loop's
    clipping and after_clipping, maybe_check, due_next, a checkpoint's state_dict and load_state_dict, flush."""
    torch.manual_seed(0)
    model = MLP()
    if bug:
        plant_bug(model.layers[3])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if watch is not None:
        watch.setup(model)
        watch.start(0)
    for step, batch in enumerate(classification_batches(steps), start=1):
        if watch is not None:
            watch.record(batch, model=model, step=step)
        cross_entropy(model, batch).backward()
        if watch is not None:
            watch.before_optimizer_step(model, loss, step=step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if watch is not None:
            watch.after_clipping(model, MAX_NORM, step=step)
        optimizer.step()
        optimizer.zero_grad()
        if watch is not None:
            watch.maybe_check(model, batch, loss, step=step)
            watch.due_next(step)
            watch.load_state_dict(watch.state_dict())  # a checkpoint saved and resumed from
    if watch is not None:
        watch.flush()
    return state_of(model, optimizer)


def _watch(tmp_path: Path, **options: Any) -> GradientWatch:
    sink = sinks.JsonLinesSink(tmp_path / "gradwatch.jsonl")
    return GradientWatch(
        sinks=[sink], **{"every_n_steps": 2, "applied_every_n_steps": 2, "max_overhead": None, **options}
    )


@pytest.mark.parametrize("site", SITES, ids=_site_id)
def test_an_error_at_a_call_site_outside_a_check_is_reported_once_and_training_goes_on(
    site: tuple[Any, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unwatched = _train(None)
    watch = _watch(tmp_path)
    marker = f"injected at {_site_id(site)}"
    calls = _inject(monkeypatch, *site, InjectedError(marker))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watched = _train(watch)
    assert calls, "the site was never called: the test does not reach it"
    assert_same_state(unwatched, watched)
    notes = [note for note in watch.notes if marker in note]
    assert len(notes) == 1, watch.notes
    assert notes[0].code == NoteCode.WATCH_ERROR
    said = [str(w.message) for w in caught if marker in str(w.message) and "training goes on" in str(w.message)]
    assert len(said) == 1, said


def test_an_out_of_memory_error_in_the_float64_checksums_of_record_does_not_escape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unwatched = _train(None)
    watch = _watch(tmp_path)
    calls = _inject(monkeypatch, window.Checksums, "of", torch.OutOfMemoryError("out of memory (injected)"))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        watched = _train(watch)
    assert len(calls) >= 2  # every applied window's first record
    assert_same_state(unwatched, watched)
    assert [note.code for note in watch.notes] == [NoteCode.WATCH_ERROR]
    assert "OutOfMemoryError" in watch.notes[0]
    assert "watch.record" in watch.notes[0]
    # the windows whose recording failed are not checked in part: no applied check, and no false failure
    assert not watch.applied_reports or all(r.fault == "clipping" for r in watch.applied_reports)
    assert all(report.verdict != "fail" for report in watch.reports)


def test_what_must_propagate_still_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(GradientCheckError):  # a failing check under on_fail="raise"
        _train(_watch(tmp_path, on_fail="raise"), bug=True)
    with pytest.raises(ValueError, match="`step`"):  # a bad argument
        _watch(tmp_path).record((torch.zeros(1), torch.zeros(1)), step=0)

    def broken_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        raise InjectedError("the user's own loss")

    with pytest.raises(InjectedError, match="the user's own loss"):  # the user's loss inside a check, on_fail="raise"
        _train(_watch(tmp_path, on_fail="raise"), loss=broken_loss)
    watch = _watch(tmp_path)  # ... and under "warn", a check that could not run, as before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(watch, loss=broken_loss)
    assert watch.counts["skipped"] >= 2
    assert not watch.notes
    assert any("could not run" in str(w.message) for w in caught)
    _inject(monkeypatch, cadence.Cadence, "reached", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        _train(_watch(tmp_path))
