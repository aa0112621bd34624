"""How the ladder judges a probe's stencils: the one thing the recomputed and the applied check do differently.

The ladder (:mod:`.ladder`) decides which stencils a probe gets (a screen, a full stencil, a confirmation at ``0.3 h``,
a finer step); a :class:`Judge` says what each of them means:

* :class:`Tolerance`, the recomputed check's: a relative tolerance (its own per tensor where a 16-bit model's floor
  was measured, :mod:`.tolerances`) above the probe's own error;
* the applied check's judges each probe against the training path's measured noise floor along its direction
  (:class:`gradwatch.engine.applied.verdict.FloorJudge`).
"""

from __future__ import annotations

from typing import Protocol

from gradwatch.engine.measuring.points import Measurements
from gradwatch.engine.numerics.assessment import Assessment, assess, confirm, screen, undecided
from gradwatch.engine.numerics.stencil import Stencil
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.probing.tolerances import TensorTolerances, task_rtol


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
