"""The measuring service of an applied check, :class:`WindowMeasurements`: the check's
:class:`~gradwatch.engine.measuring.points.Measurements` with what a window adds.

* **Screens kept for a second pass**: a check whose floor is measured only when a probe needs it (:mod:`.measurement`)
  probes the same point twice; the second pass takes the first one's screens (by probe and step).
* **The centre evaluated only when a stencil needs it**: a float64 pass evaluates no loss at the unperturbed point up
  front. It cancels out of a screen's central difference, and the first screen's mean ``(φ(h) + φ(−h)) / 2 = φ(0) +
  O(h²)`` stands in for it in the window's reproducibility test (within
  :func:`~gradwatch.engine.numerics.steps.center_tolerance`, a hundred times wider than the ``h²`` term) and a
  screen's rounding quantum. The centre itself is evaluated for a full stencil, a screen whose two points are equal,
  or a pair mean beyond that tolerance (the centre then decides, as it always did).
* **The round-off of one loss evaluation** the screens borrow: ``ε₆₄ · |L|`` :data:`ROUNDING_ULPS` times over in
  float64, measured natively by the descent probe's full stencil (:class:`~.verdict.FloorJudge`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch

from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.measuring.directions import Direction
from gradwatch.engine.measuring.points import Measurements
from gradwatch.engine.numerics.stencil import Stencil
from gradwatch.engine.numerics.steps import center_tolerance, machine_epsilon
from gradwatch.errors import NotReproducibleError

ROUNDING_ULPS = 8.0
"""The round-off of one float64 loss evaluation, in units of its last place, that a screen assumes (generous: float64
round-off lies orders of magnitude below every tolerance of a float32 or 16-bit gradient)."""


class WindowMeasurements(Measurements):
    """The window loss at the points of an applied check's probes (see the module doc).

    Args:
        evaluator: The window's evaluator (on float64 storage for float64 probes).
        center: The loss at the unperturbed point, as far as it is known.
        reference: The window's loss as it was differentiated: the magnitude the float64 round-off assumes (the same
            in every pass, which then takes the same steps), and what the centre must reproduce.
        native_dtype: The parameters' dtype.
        pending: ``center`` is not the loss at the centre yet (the first screen's mean stands in for it).
        screens: The screens of an earlier pass over the same point, by probe and step, with the centre as far as it
            was known (filled in for a later pass).
    """

    def __init__(self, evaluator: LossEvaluator, center: float, *, reference: float, native_dtype: torch.dtype,
                 pending: bool, screens: dict[Any, Any]) -> None:  # fmt: skip
        super().__init__(evaluator, center)
        self.reference = reference
        self.native_dtype = native_dtype
        self.pending = pending
        self.screens = screens
        # before any evaluation on float64 storage, its values are taken to be float64 (:meth:`_centred` checks)
        unknown = pending and "pair" not in screens
        self.assumed_epsilon = machine_epsilon(torch.float64) if unknown else self.value_epsilon
        """The machine epsilon of the loss's values as far as it is known."""
        self.loss_noise = (
            ROUNDING_ULPS * self.assumed_epsilon * abs(reference) if self.compute_dtype == torch.float64 else math.inf
        )
        """The round-off of one loss evaluation (``inf`` until the descent probe measures it natively)."""

    def screen(self, direction: Direction, step: float, key: Hashable = None) -> Stencil:
        """A screen kept from an earlier pass, or measured now (:meth:`_centred`) and kept."""
        kept = (key, step, self.compute_dtype)
        if kept not in self.screens:
            self.screens[kept] = self._centred(super().screen(direction, step))
        return self.screens[kept]

    def centred(self, stencil: Stencil) -> Stencil:
        """``stencil`` around the loss at the centre, evaluated now if it is pending (raising
        :class:`NotReproducibleError` where it does not reproduce the differentiated loss)."""
        if self.pending:
            center = self.evaluator.loss()
            self.screens[self.compute_dtype] = center
            self.pending = False
            self.center = center
            if not self._reproduces(center):
                raise NotReproducibleError(center)
        return Stencil(stencil.step, self.center, stencil.analytic, stencil.points)

    def _centred(self, screen: Stencil) -> Stencil:
        """``screen`` around the centre as far as it is known: the first screen's mean while the centre is pending, else
        the loss there where the mean does not reproduce the differentiated loss or the two points are equal."""
        if not self.pending:
            return screen
        if "pair" not in self.screens:
            values = [p.value for p in screen.points]
            mean = math.fsum(values) / len(values)
            self.screens["pair"] = mean
            if self.value_epsilon != self.assumed_epsilon:  # the loss rounds its value to a coarser dtype
                self.assumed_epsilon = self.value_epsilon
                self.loss_noise = ROUNDING_ULPS * self.assumed_epsilon * abs(self.reference)
                return self.centred(screen)
            if not math.isfinite(mean) or not self._reproduces(mean) or values[0] == values[1]:
                return self.centred(screen)
            self.center = mean
        elif screen.points[0].value == screen.points[1].value:
            return self.centred(screen)
        return Stencil(screen.step, self.center, screen.analytic, screen.points)

    def _reproduces(self, center: float) -> bool:
        tolerance = center_tolerance(self.reference, self.native_dtype, self.compute_dtype)
        return not abs(center - self.reference) > tolerance
