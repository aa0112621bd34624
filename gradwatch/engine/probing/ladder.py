"""How a probe escalates: certainty is paid for only where it is needed.

Every rung measures more, and only probes that the rung below could not settle climb:

1. the **anchor** (the descent probe, or the input direction) is a full stencil (``±h``, ``±h/2``) that measures its own
   error; its noise, in loss units, is what the screens borrow;
2. every other probe starts as a two-point **screen** (``±h``);
3. a screen beyond the tolerance ("suspect") is completed into a **full stencil** with its own error estimate;
4. a full stencil that disagrees is **confirmed** by an independent stencil at ``0.3 h``, and fails only if the
   discrepancy reproduces;
5. a probe along a whole direction that stays undecided (kinks, round-off) is measured again at a **finer step**;
6. a native probe of a model too large for float64 probes that stays undecided is **measured again in float64**.

What each stencil means is the judge's (:class:`Judge`, the one thing the recomputed and the applied check do
differently): a relative tolerance above the probe's own error for the recomputed check (:class:`Tolerance`; its own
per tensor where a 16-bit model's floor was measured, :mod:`.tolerances`), the training path's measured noise floor
along the probe's direction for the applied one (:class:`gradwatch.engine.applied.verdict.FloorJudge`); the judge also
says which undecided probes the last two rungs take.

Where the check evaluates points in vectorised passes, each rung asks for all its points at once
(:meth:`~gradwatch.engine.measuring.points.Measurements.prefetch`) before judging them one by one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from gradwatch.engine.function.complex_params import autograd_tensor
from gradwatch.engine.measuring.points import Measurements
from gradwatch.engine.numerics.assessment import Assessment, assess, confirm, screen, undecided
from gradwatch.engine.numerics.stencil import HALF_OFFSETS, PAIR_OFFSETS, Point, Stencil
from gradwatch.engine.numerics.steps import CONFIRMATION_STEP, finer_step, machine_epsilon, relative_step
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.probing.tolerances import TensorTolerances, task_rtol
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.errors import passes_fallbacks


class Judge(Protocol):
    """What a probe's stencils say (see the module doc)."""

    def screen(self, task: ProbeTask, stencil: Stencil, measurements: Measurements, loss_noise: float) -> Assessment:
        """A two-point screen's verdict, its noise borrowed (``loss_noise``: one loss evaluation's round-off); a
        ``"suspect"`` one is completed into a full stencil."""
        ...

    def assess(self, task: ProbeTask, stencil: Stencil, measurements: Measurements) -> Assessment:
        """A full stencil's verdict, against the error it measures for itself; a ``"fail"`` is confirmed."""
        ...

    def confirm(self, task: ProbeTask, first: Assessment, second: Stencil, measurements: Measurements) -> Assessment:
        """The verdict of a failing full stencil (``task.stencil``, judged ``first``) with an independent second one at
        a smaller step."""
        ...

    def undecided(self, task: ProbeTask, result: Assessment) -> bool:
        """Whether an inconclusive result hides a discrepancy worth measuring again (at a finer step, in float64)."""
        ...


class Tolerance:
    """The recomputed check's judge: a probe agrees within the relative tolerance ``rtol`` (or its tensor's own, from
    ``tolerances``) beyond its own measured error."""

    def __init__(self, rtol: float, tolerances: TensorTolerances | None = None) -> None:
        self.rtol = rtol
        self.tolerances = tolerances

    def rtol_of(self, task: ProbeTask) -> float:  # its tensor's own where the check has one per tensor
        return task_rtol(task, self.rtol, self.tolerances)

    def screen(self, task: ProbeTask, stencil: Stencil, measurements: Measurements, loss_noise: float) -> Assessment:
        return screen(
            stencil,
            rtol=self.rtol_of(task),
            scale_floor=task.scale_floor,
            value_epsilon=measurements.value_epsilon,
            loss_noise=loss_noise + measurements.jitter,
        )

    def assess(self, task: ProbeTask, stencil: Stencil, measurements: Measurements) -> Assessment:
        return assess(
            stencil,
            rtol=self.rtol_of(task),
            scale_floor=task.scale_floor,
            value_epsilon=measurements.value_epsilon,
            jitter=measurements.jitter,
        )

    def confirm(self, task: ProbeTask, first: Assessment, second: Stencil, measurements: Measurements) -> Assessment:
        return confirm(first, self.assess(task, second, measurements))

    def undecided(self, task: ProbeTask, result: Assessment) -> bool:
        return undecided(result, self.rtol_of(task))


FULL_OFFSETS = PAIR_OFFSETS + HALF_OFFSETS
"""The points of a full stencil."""

LOCALIZED_AT_MOST = 8
"""After a failure every tensor is screened; at most this many of those that look wrong are measured further, the most
significant first. A wrong backward deep in a large model makes every tensor upstream of it wrong, and measuring each
(full stencils, a confirmation) cost a diffusion UNet hundreds of loss evaluations per failing check; the culprit
search, not the list of victims, says where the bug is."""


def significance(task: ProbeTask) -> float:
    """How many times its noise the discrepancy of the task's last result is."""
    result = task.result
    assert result is not None
    return abs(result.discrepancy) / result.noise if result.noise > 0 else math.inf


class Ladder:
    """Measures probes over ``measurements`` and escalates those that need it (see the module doc). ``judge`` says what
    each stencil means (:mod:`.judges`), by default the check's ``rtol`` (or each probe's own, from ``tolerances``);
    ``native_dtype`` is the checked gradient's; a float64 re-measurement (``float64_refinement``, of undecided native
    probes) must reproduce ``reference_loss``."""

    def __init__(
        self,
        measurements: Measurements,
        *,
        judge: Judge | None = None,
        rtol: float = 0.0,
        native_dtype: torch.dtype,
        reference_loss: float,
        float64_refinement: bool = False,
        tolerances: TensorTolerances | None = None,
    ) -> None:
        self.measurements = measurements
        self.judge: Judge = judge if judge is not None else Tolerance(rtol, tolerances)
        self.rtol = rtol
        self.tolerances = tolerances
        self.native_dtype = native_dtype
        self.probe_dtype = measurements.compute_dtype
        self.reference_loss = reference_loss
        self.float64_refinement = float64_refinement
        self.loss_noise = math.inf
        """The round-off of one loss evaluation, in loss units, as the anchor's full stencil measured it."""

    def first_round(self, anchor: ProbeTask, screens: Sequence[ProbeTask]) -> None:
        """Measure the anchor's full stencil, then screen (and escalate) every screen, all their points ahead."""
        self._prefetch([(anchor, FULL_OFFSETS)] + [(task, PAIR_OFFSETS) for task in screens])
        self._full(anchor)
        assert anchor.result is not None
        self.loss_noise = anchor.result.loss_noise
        self.screen_and_escalate(screens)

    def screen_and_escalate(self, tasks: Sequence[ProbeTask], most: int | None = None) -> list[ProbeTask]:
        """Screen every task; complete the suspect ones into full stencils (and on up the ladder), at most ``most`` of
        them, the most significant first. Returns the suspects left unmeasured, made inconclusive."""
        self.screen(tasks)
        return self.escalate(tasks, most)

    def screen(self, tasks: Sequence[ProbeTask]) -> None:
        """Measure a two-point screen of every task, their points ahead, and judge it."""
        self._prefetch([(task, PAIR_OFFSETS) for task in tasks])
        for task in tasks:
            task.evaluations += len(PAIR_OFFSETS)
            task.stencil = self.measurements.screen(task.direction, task.step, key=(task.kind, task.moves, task.target))
            task.result = self.judge.screen(task, task.stencil, self.measurements, self.loss_noise)

    def escalate(self, tasks: Sequence[ProbeTask], most: int | None = None) -> list[ProbeTask]:
        """Complete the screened tasks that look wrong into full stencils (and on up the ladder), at most ``most`` of
        them, the most significant first. Returns the suspects left unmeasured, made inconclusive."""
        suspects = [task for task in tasks if task.result is not None and task.result.verdict == "suspect"]
        left: list[ProbeTask] = []
        if most is not None and len(suspects) > most:
            suspects.sort(key=significance, reverse=True)
            suspects, left = suspects[:most], suspects[most:]
            for task in left:
                task.mark("inconclusive", "unresolved")
        self._prefetch([(task, HALF_OFFSETS) for task in suspects])
        for task in suspects:
            self._full(task)
        return left

    def remeasure_in_float64(self, tasks: Sequence[ProbeTask]) -> None:
        """Measure again, on float64 storage, the parameter probes whose native stencils saw a discrepancy beyond the
        tolerance but could not resolve it: float64 removes the round-off, so they end "ok" or "fail"."""
        pending = [
            task
            for task in tasks
            if task.kind.traits.moves_parameters and task.result is not None and self.judge.undecided(task, task.result)
        ]
        if not pending or not self.float64_refinement:
            return
        notes = self.measurements.evaluator.notes
        try:
            moved = {id(autograd_tensor(t)) for task in pending for t in getattr(task.direction, "tensors", ())}
            with self.measurements.in_float64(self.reference_loss, self.native_dtype, moved) as substitutes:
                if substitutes is None:
                    return
                for task in pending:
                    task.direction.substitute(substitutes)  # perturb the float64 copies the model now uses
                    probe_step = relative_step(self.probe_dtype, self.native_dtype, direction=task.index is None)
                    task.step = task.initial_step * relative_step(torch.float64, self.native_dtype) / probe_step
                    task.stencil = None
                    self._full(task)
        except Exception as error:
            if passes_fallbacks(error):
                raise
            notes.append(Note(NoteCode.NO_FLOAT64_REMEASUREMENT, (
                f"no float64 re-measurement: the loss raised {type(error).__name__} ({error})")))  # fmt: skip
            return
        notes.append(
            Note(NoteCode.REMEASURED_IN_FLOAT64, f"{len(pending)} undecided probe(s) measured again in float64")
        )

    def measure_fully(self, tasks: Sequence[ProbeTask]) -> None:
        """Measure the tasks with full stencils from the start (and on up the ladder), their points ahead: for probes
        whose screens would borrow a noise estimate the check does not have (the same probes at another point)."""
        self._prefetch([(task, FULL_OFFSETS) for task in tasks])
        for task in tasks:
            self._full(task)

    def _full(self, task: ProbeTask) -> None:
        """Complete the task's stencil (reusing a screen's ``±h``) and judge it; a failure must be confirmed by an
        independent stencil at a smaller step. A probe along a whole direction that stays undecided (kinks, round-off)
        is measured once more at a finer step, where it crosses fewer kinks; a coordinate is replaced instead (by the
        portfolio)."""
        self._full_at_step(task)
        result = task.result
        assert result is not None
        if task.index is not None or not self.judge.undecided(task, result):
            return
        finer = finer_step(
            task.step,
            center=self.measurements.center,
            scale=result.scale,
            rtol=task_rtol(task, self.rtol, self.tolerances),
            compute_epsilon=machine_epsilon(self.measurements.compute_dtype),
        )
        if finer is not None:
            task.step = finer
            task.stencil = None
            self._prefetch([(task, FULL_OFFSETS)])
            self._full_at_step(task)

    def _full_at_step(self, task: ProbeTask) -> None:
        if task.stencil is None or task.stencil.step != task.step:
            task.stencil = self._stencil(task, task.step, PAIR_OFFSETS)
        task.stencil = self.measurements.centred(task.stencil).extended(self._points(task, task.step, HALF_OFFSETS))
        first = self.judge.assess(task, task.stencil, self.measurements)
        if first.verdict != "fail":
            task.result = first
            return
        confirming = task.step * CONFIRMATION_STEP
        self._prefetch([(task, FULL_OFFSETS)], step=confirming)
        second = self._stencil(task, confirming, FULL_OFFSETS)
        task.result = self.judge.confirm(task, first, second, self.measurements)
        task.step = confirming

    def _points(self, task: ProbeTask, step: float, offsets: Sequence[float]) -> tuple[Point, ...]:
        task.evaluations += len(offsets)
        return self.measurements.points(task.direction, step, offsets)

    def _stencil(self, task: ProbeTask, step: float, offsets: Sequence[float]) -> Stencil:
        task.evaluations += len(offsets)
        return self.measurements.stencil(task.direction, step, offsets)

    def _prefetch(self, requests: Sequence[tuple[ProbeTask, Sequence[float]]], step: float | None = None) -> None:
        """Ask for the points ``offset × task.step`` (or ``offset × step``) of each ``(task, offsets)`` ahead."""
        self.measurements.prefetch(
            [(task.direction, task.step if step is None else step, offsets) for task, offsets in requests]
        )
