"""Finite-difference arithmetic: steps, derivative estimates and their own error.

A probe evaluates the loss ``φ`` at ``±h`` and ``±h/2`` along a direction. Each value is compared with autograd's
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

import torch


def machine_epsilon(dtype: torch.dtype) -> float:
    """The machine epsilon of a floating dtype."""
    return float(torch.finfo(dtype).eps)


@dataclass(frozen=True)
class Stencil:
    """The loss along one direction at ``+h, −h, +h/2, −h/2`` (in that order).

    Attributes:
        step: The nominal step ``h``.
        center: The loss at the origin.
        analytic: Autograd's derivative along the direction.
        values: The loss at the four points.
        along: The displacement actually obtained along the direction at each point.
        predicted: Autograd's first-order prediction ``g·δ`` of the loss change at each point.
    """

    step: float
    center: float
    analytic: float
    values: tuple[float, ...]
    along: tuple[float, ...]
    predicted: tuple[float, ...]

    def deviations(self) -> tuple[float, ...]:
        """``ψ(t) = φ(t) − φ(0) − g·δ(t)`` at each point."""
        return tuple(v - self.center - p for v, p in zip(self.values, self.predicted, strict=True))

    def discrepancy(self, pair: int) -> float:
        """``e`` for the central difference of pair 0 (``±h``) or pair 1 (``±h/2``)."""
        psi = self.deviations()
        plus, minus = 2 * pair, 2 * pair + 1
        return (psi[plus] - psi[minus]) / (self.along[plus] - self.along[minus])

    @property
    def richardson(self) -> float:
        """The Richardson-extrapolated discrepancy ``(4·e(h/2) − e(h)) / 3``."""
        return (4 * self.discrepancy(1) - self.discrepancy(0)) / 3

    @property
    def numeric(self) -> float:
        """The finite-difference derivative along the direction."""
        return self.analytic + self.richardson

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
        return all(math.isfinite(v) for v in (self.center, *self.values))

    @property
    def flat(self) -> bool:
        """Whether every perturbed loss equals the centre bit for bit: the steps are below the loss's resolution."""
        return all(v == self.center for v in self.values)


SIGNIFICANCE = 5.0
"""A discrepancy counts only when it exceeds this many times the probe's error estimate (measured on correct models in
float32: 99% of probes stay below 3, none above 5 that also exceeded the relative tolerance)."""

RESOLUTION = 0.05
"""A probe that agrees is "ok" only if it could have seen a relative error of this size (``SIGNIFICANCE · noise`` below
this fraction of the derivative's scale); otherwise it is "inconclusive"."""

AGREEMENT = 0.25
"""A confirmed discrepancy reproduces to within this fraction at an independent second step."""

CONFIRMATION_STEP = 0.3
"""The confirming stencil uses ``h × 0.3``: its points share none with the first stencil's."""

KINK_RETRY_STEP = 0.125
"""When the descent probe's stencil crosses kinks (ReLU units changing sides), it measures again at ``h / 8``: that
crosses about eight times fewer, and its signal is large enough to afford the extra round-off."""

_RELATIVE_TOLERANCE = {
    torch.float64: 1e-6,
    torch.float32: 1e-3,
    torch.float16: 3e-2,
    torch.bfloat16: 1e-1,
}


def relative_tolerance(dtype: torch.dtype) -> float:
    """The default relative tolerance for derivatives computed in ``dtype``.

    Above float rounding of the analytic gradient itself (float32 autograd is ~1e-5 off the exact derivative on large
    summed losses, up to ~2e-4 on a model that memorised its data) and below the 1% errors that must be caught.
    """
    return _RELATIVE_TOLERANCE.get(dtype, 1e-3)


def relative_step(dtype: torch.dtype) -> float:
    """Step size relative to the scale of the perturbed value: ``ε^(1/5)``, the optimum for a Richardson-extrapolated
    central difference (truncation ``O(h⁴)``, round-off ``O(ε/h)``); 0.041 in float32, 7.4e-4 in float64."""
    return machine_epsilon(dtype) ** 0.2


@dataclass(frozen=True)
class Assessment:
    """What one stencil says about one derivative.

    Attributes:
        numeric: The finite-difference derivative.
        discrepancy: ``numeric − analytic``.
        noise: The estimated error of ``numeric``: round-off and truncation, from the stencil's own residuals.
        scale: The denominator of the relative error.
        verdict: ``"ok"``, ``"fail"`` or ``"inconclusive"`` (a ``"fail"`` here is a candidate until confirmed).
        reason: See :attr:`gradwatch.report.Probe.reason`.
    """

    numeric: float
    discrepancy: float
    noise: float
    scale: float
    verdict: str
    reason: str

    @property
    def rel_error(self) -> float:
        return abs(self.discrepancy) / self.scale if self.scale > 0 else 0.0


def assess(stencil: Stencil, *, rtol: float, scale_floor: float, value_epsilon: float) -> Assessment:
    """Judge one stencil.

    Args:
        stencil: The loss values of the probe.
        rtol: Relative tolerance: smaller discrepancies are accepted even when significant.
        scale_floor: Lower bound of the relative error's denominator (see :func:`scale_floor`).
        value_epsilon: Machine epsilon of the dtype the loss values were delivered in; their quantisation is the
            smallest error any probe can have.
    """
    analytic = stencil.analytic
    if not stencil.finite:
        return Assessment(math.nan, math.nan, math.inf, abs(analytic), "inconclusive", "nonfinite")
    if stencil.flat:
        # the loss does not move and autograd says it should not, or only by float noise (a bias before BatchNorm)
        if abs(analytic) <= rtol * scale_floor:
            return Assessment(0.0, -analytic, 0.0, scale_floor, "ok", "agrees")
        # A float loss can be a staircase: a saturated cross-entropy computes log(1 + x) with 1 + x rounded to 1, so
        # steps that change the true loss by less than a rounding quantum change nothing. Its residuals are then exactly
        # zero, which says nothing about the noise: the probe has no information.
        return Assessment(0.0, -analytic, abs(analytic), max(abs(analytic), scale_floor), "inconclusive", "flat")
    discrepancy = stencil.richardson
    numeric = analytic + discrepancy
    roughness = abs(stencil.even_residual) / stencil.step
    quantum = value_epsilon * max(abs(stencil.center), 1e-30) / stencil.step
    # E(h) - E(h/2) has ~0.8x, the fourth difference ~4.4x the round-off of the Richardson estimate (for independent
    # rounding errors); the odd residual also bounds what truncation is left.
    noise = 1.2 * abs(stencil.odd_residual) + 0.25 * roughness + quantum
    scale = max(abs(analytic) + abs(numeric), scale_floor)
    size = abs(discrepancy)
    if size <= rtol * scale:
        resolved = SIGNIFICANCE * noise <= RESOLUTION * scale
        return Assessment(
            numeric, discrepancy, noise, scale, *(("ok", "agrees") if resolved else ("inconclusive", "unresolved"))
        )
    if size <= SIGNIFICANCE * noise:
        reason = "kink" if roughness > size else "unresolved"
        return Assessment(numeric, discrepancy, noise, scale, "inconclusive", reason)
    return Assessment(numeric, discrepancy, noise, scale, "fail", "discrepancy")


def confirm(first: Assessment, second: Assessment) -> Assessment:
    """Combine a suspicious first assessment with an independent second one at another step.

    The discrepancy stands only if the second stencil finds it too, of the same size (within :data:`AGREEMENT`): a wrong
    gradient is wrong by the same amount at any step, while round-off and kinks are not reproducible. If the second
    stencil agrees with autograd instead, its "ok" stands; anything else is inconclusive.
    """
    if second.verdict == "fail":
        spread = abs(first.discrepancy - second.discrepancy)
        if spread <= AGREEMENT * max(abs(first.discrepancy), abs(second.discrepancy)):
            return second
        return Assessment(
            second.numeric, second.discrepancy, max(second.noise, spread), second.scale, "inconclusive", "unstable"
        )
    if second.verdict == "ok":
        return second
    return Assessment(second.numeric, second.discrepancy, second.noise, second.scale, "inconclusive", second.reason)
