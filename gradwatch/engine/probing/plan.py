"""What the probes of a recomputed check are asked to do, as one object: :class:`ProbePlan`.

The check (:mod:`gradwatch.engine.recomputed.check`) makes it once; the probes, their confirmations and the culprit
search take it whole, with the ladder it builds for any measurements (:meth:`ProbePlan.ladder`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from gradwatch.engine.function.precision import ResolvedPrecision
from gradwatch.engine.measuring.points import Measurements
from gradwatch.engine.probing.ladder import Ladder
from gradwatch.engine.probing.portfolio import PortfolioTurn
from gradwatch.engine.probing.search_budget import SearchBudget
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.probing.tolerances import TensorTolerances, task_rtol


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbePlan:
    """What the probes of a check are asked to do.

    Attributes:
        measure_floor: Whether a 16-bit model's tolerance is measured on its path (no ``rtol`` given; see
            :mod:`gradwatch.engine.recomputed.sixteen_bit_floor`).
        measured_floor: Whether ``rtol`` is that measured tolerance: it then already is the rounding a correct gradient
            shows, and a larger error does not pass for rounding.
        check_formula: Whether float64 probes of a float32 gradient that pass within the tolerance but are significantly
            off have their formula checked in float64 (no ``rtol`` given: a tolerance the user chose is what they
            accept; see :mod:`gradwatch.engine.recomputed.formula`).
        tolerances: The tolerance of each probe from a floor measured per tensor (:mod:`.tolerances`); ``rtol`` is
            then the largest, which probes of inputs and activations keep.
        priced: Whether float64 probes give way to native ones where float64 costs too much on the device
            (``precision="auto"``; see :func:`gradwatch.engine.function.precision.probe_precision`).
        step_seconds: What a priced check's native reference pass took: the price float64 is compared with.
        search_budget: The cap on a failing check's culprit search and where it resumes (``None``: no cap, from the
            loss; :mod:`.search_budget`).
    """

    portfolio: PortfolioTurn  # which probes, how many, in which turn
    rtol: float
    native_dtype: torch.dtype  # the parameters' (the least precise of them)
    float64_refinement: bool  # whether undecided native probes are measured again in float64
    vectorize: bool  # whether points may be evaluated together in vectorised passes
    fail_on_imprecise: bool  # whether a native gradient off by more than rtol only by its rounding fails
    precision: ResolvedPrecision = "native"  # what the probes are asked for
    measure_floor: bool = False
    measured_floor: bool = False
    check_formula: bool = False
    tolerances: TensorTolerances | None = None
    priced: bool = False
    step_seconds: float = math.nan
    search_budget: SearchBudget | None = None

    @property
    def seed(self) -> str:
        """The seed of the check's random choices beyond the portfolio (a shifted point): its seed and step."""
        return f"{self.portfolio.probes.seed}:{self.portfolio.step}"

    def ladder(self, measurements: Measurements, reference_loss: float) -> Ladder:
        return Ladder(
            measurements,
            rtol=self.rtol,
            native_dtype=self.native_dtype,
            reference_loss=reference_loss,
            float64_refinement=self.float64_refinement,
            tolerances=self.tolerances,
        )

    def rtol_of(self, task: ProbeTask) -> float:  # see `tolerances`
        return task_rtol(task, self.rtol, self.tolerances)
