"""Finite-difference arithmetic: steps, derivative estimates and their own error.

A probe first screens the loss ``φ`` at ``±h`` along a direction; a screen that looks wrong is extended with the points
``±h/2`` into a full stencil, which measures its own error. Each value is compared with autograd's
first-order prediction for the displacement float arithmetic actually produced, ``ψ(t) = φ(t) − φ(0) − g·δ(t)``, so a
step that did not land exactly where intended costs nothing. From the four points:

* ``e(h) = (ψ(h) − ψ(−h)) / (s(h) − s(−h))`` is the discrepancy between the central difference and autograd at step
  ``h`` (``s`` the displacement along the direction); ``e(h/2)`` likewise.
* Richardson's ``(4·e(h/2) − e(h)) / 3`` cancels the ``h²`` truncation term: the numeric derivative is
  ``analytic + e_R``.
* ``e(h) − e(h/2)`` (odd residual) measures truncation plus round-off; the fourth difference
  ``ψ(h) + ψ(−h) − 4·(ψ(h/2) + ψ(−h/2))`` (even residual) is ``O(h⁴)`` for a smooth loss and so exposes round-off and
  kinks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    """One evaluation of a probe: the loss ``value`` at nominal ``offset × h`` (``±1`` or ``±0.5``) along the direction,
    the displacement ``along`` it actually obtained, and autograd's first-order prediction ``g·δ`` of the loss change
    for it (``predicted``)."""

    offset: float
    value: float
    along: float
    predicted: float


PAIR_OFFSETS = (1.0, -1.0)
"""The screen: a central difference at ``±h``."""

HALF_OFFSETS = (0.5, -0.5)
"""The extension that turns a screen into a full stencil: a second central difference at ``±h/2``."""


@dataclass(frozen=True)
class Stencil:
    """The loss along one direction at ``±h`` (a screen) or at ``±h`` and ``±h/2`` (a full stencil): ``points``, ``±h``
    first, around the ``center`` loss, with ``step`` the nominal ``h`` and autograd's derivative along the direction,
    ``analytic``."""

    step: float
    center: float
    analytic: float
    points: tuple[Point, ...]

    @property
    def full(self) -> bool:
        """Whether the stencil has the ``±h/2`` points (else it is a two-point screen)."""
        return len(self.points) == 4

    def extended(self, points: tuple[Point, ...]) -> Stencil:
        """This stencil with more points (the ``±h/2`` pair)."""
        return Stencil(self.step, self.center, self.analytic, self.points + points)

    def _deviation(self, point: Point) -> float:
        return point.value - self.center - point.predicted

    def deviations(self) -> tuple[float, ...]:
        """``ψ(t) = φ(t) − φ(0) − g·δ(t)`` at each point."""
        return tuple(self._deviation(p) for p in self.points)

    def discrepancy(self, pair: int) -> float:
        """``e`` for the central difference of pair 0 (``±h``) or pair 1 (``±h/2``)."""
        plus, minus = self.points[2 * pair], self.points[2 * pair + 1]
        return (self._deviation(plus) - self._deviation(minus)) / (plus.along - minus.along)

    def span(self, pair: int = 0) -> float:
        """The distance between the two points of a pair, along the direction."""
        return abs(self.points[2 * pair].along - self.points[2 * pair + 1].along)

    @property
    def richardson(self) -> float:
        """The Richardson-extrapolated discrepancy ``(4·e(h/2) − e(h)) / 3``."""
        return (4 * self.discrepancy(1) - self.discrepancy(0)) / 3

    @property
    def numeric(self) -> float:
        """The finite-difference derivative along the direction (Richardson-extrapolated on a full stencil)."""
        return self.analytic + (self.richardson if self.full else self.discrepancy(0))

    @property
    def odd_residual(self) -> float:
        """``e(h) − e(h/2)``: truncation plus round-off, in derivative units."""
        return self.discrepancy(0) - self.discrepancy(1)

    @property
    def even_residual(self) -> float:
        """The fourth difference of ``ψ``, in loss units: ``O(h⁴)`` when smooth, round-off or a kink otherwise."""
        psi = self.deviations()
        return psi[0] + psi[1] - 4 * (psi[2] + psi[3])

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in (self.center, *(p.value for p in self.points)))

    @property
    def flat(self) -> bool:
        """Whether every perturbed loss equals the centre bit for bit: the steps are below the loss's resolution."""
        return all(p.value == self.center for p in self.points)
