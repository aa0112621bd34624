"""What a run's recomputed checks teach the next ones: :class:`Lessons`.

The ``ignore`` patterns that match the model (those that match nothing warned of once), the probe slice the loss
accepts, whether it vectorises, the focus (the tensors the last check could not decide or saw fail, probed again at the
next check, so a wrong gradient found once is confirmed at every check), and where a failing check's culprit search
stopped at its cap, for the next failing check to go on from (:mod:`gradwatch.engine.probing.search_budget`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from gradwatch.engine import CheckReport
from gradwatch.engine.function.memory import backed_off, free_memory
from gradwatch.engine.probing.search_budget import SearchBudget
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.selection import unmatched_patterns
from gradwatch.engine.settings import ProbeSettings
from gradwatch.watch.alerts import GradientCheckWarning
from gradwatch.watch.defaults import MIN_CULPRIT_SEARCH_SECONDS


class Lessons:
    """The settings the next check runs with (:attr:`active`, from the run's ``settings``) and its :attr:`focus`,
    learnt from the reports."""

    def __init__(self, settings: ProbeSettings) -> None:
        self.settings = settings
        self.active = settings
        self.focus: tuple[str, ...] = ()
        self.search_within: tuple[str, ...] = ()  # where the last failing check's culprit search stopped at its cap
        self.search_candidates: tuple[str, ...] = ()
        self.search_clock: Callable[[], float] = time.perf_counter  # the searches' clock (a test counts instead)
        self.search_min_seconds = MIN_CULPRIT_SEARCH_SECONDS
        self.step_stand_in: float | None = None  # an applied check's window pass: a training step before one is timed
        self.float64 = Float64Backoff()  # the applied checks' float64 probes, after they ran out of memory
        self._set_up_for: int | None = None  # id of the model the ignore patterns were matched to
        self._warned_no_params = False

    def checkable(self, model: nn.Module) -> bool:
        """Whether the model has a trainable floating parameter to check; warns once when it has none."""
        if any(p.requires_grad and p.is_floating_point() for p in model.parameters()):
            return True
        if not self._warned_no_params:
            self._warned_no_params = True
            warnings.warn(
                f"gradwatch: {type(model).__name__} has no trainable floating-point parameter (layers kept in a plain "
                "list or dict are not registered); its checks are skipped",
                GradientCheckWarning,
                stacklevel=5,
            )
        return False

    def set_up(self, model: nn.Module, *, force: bool = True) -> None:
        """Match the ``ignore`` patterns to the model's parameter names (once per model unless ``force``): each
        pattern that matches none warns, with the names meant; the checks then get only the patterns that match."""
        if not force and self._set_up_for == id(model):
            return
        self._set_up_for = id(model)
        names = [name for name, _ in model.named_parameters()]
        for message in unmatched_patterns(self.settings.ignore, names):
            warnings.warn(f"gradwatch: {message}", GradientCheckWarning, stacklevel=4)
        matched = tuple(p for p in self.settings.ignore if any(fnmatch.fnmatchcase(name, p) for name in names))
        self.active = dataclasses.replace(self.active, ignore=matched)

    def search_budget(self, steps: int | None, step_seconds: float) -> SearchBudget:
        """The culprit search budget of the next check: ``steps`` training steps of ``step_seconds`` each, from where
        the last search stopped. While the run's step time is unknown (``nan``: at the first optimizer step, whose
        time is not measured), an applied check's forward and backward of its whole window stands in for a step
        (:meth:`learn_step`), else the check's own reference pass."""
        known = step_seconds if math.isfinite(step_seconds) and step_seconds > 0 else self.step_stand_in
        return SearchBudget(steps, known, self.search_within, self.search_candidates, clock=self.search_clock,
                            min_seconds=self.search_min_seconds)  # fmt: skip

    def learn_step(self, budget: SearchBudget) -> None:
        """The training step's stand-in an applied check's budget took from its window (its forward and backward of
        every micro-batch), for the checks made before the run has timed a step: a recomputed check's own reference
        pass covers one micro-batch, a fraction of a step under gradient accumulation."""
        seconds = budget.step_seconds
        if seconds is not None and math.isfinite(seconds) and seconds > 0:
            self.step_stand_in = seconds

    def learn_search(self, report: CheckReport) -> None:
        """Where a failing check's culprit search stopped (or the culprit it named), for the next one to go on from;
        a check that passed leaves nothing to go on from."""
        progress = report.culprit_search
        if progress is not None:
            self.search_within, self.search_candidates = progress.resume_point()
        elif report.verdict != "fail":
            self.search_within, self.search_candidates = (), ()

    def learn_applied(self, report: CheckReport) -> None:
        """What an applied check's report teaches the next one: where its search stopped, and whether its float64
        probes fit in the device's memory (a check the back-off kept native gets a note saying so)."""
        self.learn_search(report)
        if self.float64.learn(report) and report.probes:  # (a postponed check probed in no precision)
            report.notes.append(Note(NoteCode.MEMORY_NATIVE, self.float64.note()))

    def search_state(self) -> dict[str, Any]:
        """The search's resume point (plain lists of names) and the float64 back-off, as a checkpoint carries them."""
        return {"culprit_search_within": list(self.search_within),
                "culprit_search_candidates": list(self.search_candidates), **self.float64.state_dict()}  # fmt: skip

    def load_search_state(self, state: dict[str, Any]) -> None:
        self.search_within = tuple(str(name) for name in state.get("culprit_search_within", ()))
        self.search_candidates = tuple(str(name) for name in state.get("culprit_search_candidates", ()))
        self.float64.load_state_dict(state)

    def learn(self, report: CheckReport) -> None:
        """What a recomputed check's report teaches the next check."""
        self.learn_search(report)
        samples = self.active.probe_batch_size
        if samples is not None and report.samples is not None and report.samples > samples:
            # the loss refused the smaller slice: no need to try it again
            self.active = dataclasses.replace(self.active, probe_batch_size=report.samples)
        retried = report.failed_tensors[: self.active.tensor_probes]  # a wrong gradient is confirmed at every check
        self.focus = tuple(dict.fromkeys([*report.undecided, *retried]))
        if any(note.code == NoteCode.OUT_OF_MEMORY for note in report.notes):
            # one step cheaper each time: native probes, native reductions, no vectorised passes, half the probe batch
            active = self.active
            cheaper = backed_off(
                report.precision, float64_reductions=active.float64_reductions, vectorize=active.vectorize,
                probe_batch_size=active.probe_batch_size, samples=report.samples,
            )  # fmt: skip
            self.active = dataclasses.replace(active, **cheaper)
        if report.vectorized is False:
            # the loss could not be vectorised: the next checks need not try again
            self.active = dataclasses.replace(self.active, vectorize=False)


FLOAT64_RETRY_LIMIT = 64
"""The most applied checks in a row the float64 back-off keeps native before float64 probes are tried again."""


class Float64Backoff:
    """Whether a watch's next applied check tries float64 probes, after earlier ones ran out of memory (or were
    estimated not to fit): an applied check that tries float64 and runs out falls back to native probes within itself,
    but the next one would try again, in vain, every time.

    The rule: after the ``n``-th such check in a row, the next ``2**n`` applied checks (2, 4, 8, ... at most
    :data:`FLOAT64_RETRY_LIMIT`) probe natively without trying float64; then float64 is tried again, or sooner, once the
    device's free memory at a check is twice what it was when float64 last ran out (memory another part of the program
    held was freed). A check whose float64 probes fit ends the back-off."""

    def __init__(self) -> None:
        self.misses = 0  # applied checks in a row whose float64 probes did not fit
        self.left = 0  # applied checks left to probe natively
        self.free_at_miss: int | None = None  # the free memory when float64 last did not fit
        self._free: int | None = None  # at the check being made
        self._held = False  # whether the check being made was kept native

    def allows(self, model: nn.Module) -> bool:
        """Whether the applied check about to run on ``model`` tries float64 probes."""
        device = next((p.device for p in model.parameters()), None)
        self._free = free_memory(device) if device is not None else None
        grown = self._free is not None and self.free_at_miss is not None and self._free >= 2 * self.free_at_miss
        self._held = self.left > 0 and not grown
        return not self._held

    def learn(self, report: CheckReport) -> bool:
        """Count ``report`` (an applied check's); whether it was kept native by the back-off (for its note)."""
        if self._held:
            self.left -= 1
            return True
        if report.noted(NoteCode.MEMORY_NATIVE) or report.noted(NoteCode.OUT_OF_MEMORY):
            self.misses += 1
            self.left, self.free_at_miss = min(2**self.misses, FLOAT64_RETRY_LIMIT), self._free
        elif report.precision == "float64":
            self.misses, self.left, self.free_at_miss = 0, 0, None
        return False

    def note(self) -> str:
        return (
            f"probes run natively: float64 probes did not fit in the device's memory at the last {self.misses} "
            f"applied check(s) that tried them; tried again after {self.left} more, or once the free memory doubles"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"applied_float64_misses": self.misses, "applied_float64_native_left": self.left,
                "applied_float64_free_at_miss": self.free_at_miss}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.misses = int(state.get("applied_float64_misses", 0))
        self.left = int(state.get("applied_float64_native_left", 0))
        free = state.get("applied_float64_free_at_miss")
        self.free_at_miss = None if free is None else int(free)
