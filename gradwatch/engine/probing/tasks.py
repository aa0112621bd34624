"""A probe while it is being measured (:class:`ProbeTask`): what it moves, at which step, and what its stencils have
said so far. The portfolio (:mod:`.portfolio`) creates them, the ladder (:mod:`.ladder`) measures and escalates them,
and the check turns each into the :class:`~gradwatch.engine.results.report.Probe` users see.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass, replace

from gradwatch.engine.measuring.directions import Direction
from gradwatch.engine.numerics.assessment import Assessment
from gradwatch.engine.numerics.stencil import Stencil
from gradwatch.engine.results.kinds import ProbeKind, Reason, Verdict
from gradwatch.engine.results.report import Probe


@dataclass
class ProbeTask:
    """A probe being measured.

    Attributes:
        moves: What the direction moves, as positions in the check's parameters (``int``) and input paths (``str``):
            how the same probe is made again at another point (:meth:`Portfolio.replica
            <gradwatch.engine.probing.portfolio.Portfolio.replica>`).
        rtol: The probe's own tolerance where the check has one per tensor (:mod:`.tolerances`), once resolved;
            ``None``: the check's.
        floor: An applied check's: the training path's noise floor along the direction, which its judge holds the
            discrepancy against (:class:`~gradwatch.engine.applied.verdict.FloorJudge`).
    """

    kind: ProbeKind
    target: str  # the parameter name, input path or "*" the probe reports
    index: tuple[int, ...] | None  # the coordinate, None for a direction
    direction: Direction
    step: float  # the current finite-difference step along the direction
    scale_floor: float  # the smallest denominator of its relative error (numerics.assessment.assess)
    _: KW_ONLY
    tensor: int = -1  # the position of the probed parameter (or input) in the check's list, -1 for the whole network
    missing: bool = False  # autograd gave the parameter no gradient: a failure then reads "missing"
    stencil: Stencil | None = None  # the last stencil measured, and what it said
    result: Assessment | None = None
    initial_step: float = 0.0
    evaluations: int = 0  # loss evaluations spent so far
    moves: tuple[int | str, ...] = ()
    rtol: float | None = None
    floor: float = math.nan

    def __post_init__(self) -> None:
        self.kind = ProbeKind(self.kind)  # from a plain string too: its properties are `task.kind.traits`
        self.initial_step = self.step

    @property
    def failed(self) -> bool:
        """Whether the probe's last result is a failure."""
        return self.result is not None and self.result.verdict == "fail"

    def mark(self, verdict: str, reason: str) -> None:
        """Give the last result another verdict and reason, its measurements as they are."""
        assert self.result is not None
        self.result = replace(self.result, verdict=verdict, reason=reason)

    def probe(self) -> Probe:
        """The finished probe, as reported."""
        result = self.result
        assert result is not None
        # autograd gave no gradient, or exactly zero, where the loss moves: a missing gradient path
        missing = result.verdict == "fail" and (self.missing or self.direction.analytic == 0.0)
        return Probe(
            kind=self.kind,
            target=self.target,
            index=self.index,
            analytic=self.direction.analytic,
            numeric=result.numeric,
            rel_error=result.rel_error,
            verdict=Verdict(result.verdict),
            noise=result.noise,
            step=self.step,
            reason=Reason.MISSING if missing else Reason(result.reason),
            evaluations=self.evaluations,
        )
