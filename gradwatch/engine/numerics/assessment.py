"""Verdicts from stencils: what a screen, a full stencil and a confirming stencil say about one derivative.

A probe's numeric derivative is judged against the error its own stencil measures (:class:`Assessment`): agreement
within the relative tolerance is ``"ok"`` only when the probe could have seen a larger error; a discrepancy beyond
the tolerance fails only when it exceeds :data:`SIGNIFICANCE` times the probe's noise and reproduces at an independent
second step (:func:`confirm`). Kinks, round-off and flat losses end ``"inconclusive"``, never ``"fail"``.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass

from gradwatch.engine.numerics.stencil import Stencil

SIGNIFICANCE = 5.0
"""A discrepancy counts only when it exceeds this many times the probe's error estimate (measured on correct models in
float32: 99% of probes stay below 3, none above 5 that also exceeded the relative tolerance)."""

RESOLUTION = 0.05
"""A probe that agrees is "ok" only if it could have seen a relative error of this size (``SIGNIFICANCE · noise`` below
this fraction of the derivative's scale); otherwise it is "inconclusive"."""

AGREEMENT = 0.25
"""A confirmed discrepancy reproduces to within this fraction at an independent second step."""


@dataclass(frozen=True)
class Assessment:
    """What one stencil says about one derivative.

    Attributes:
        verdict: ``"ok"``, ``"fail"``, ``"inconclusive"``, or ``"suspect"`` for a screen that needs the full stencil.
            A ``"fail"`` here is a candidate until confirmed.
        loss_noise: ``noise`` in loss units (times the step): what other probes of the check may borrow as the
            round-off of one loss evaluation.
    """

    numeric: float  # the finite-difference derivative
    discrepancy: float  # numeric − analytic
    noise: float  # the estimated error of numeric (round-off, truncation, jitter), in derivative units
    scale: float  # the relative error's denominator: max(|analytic|, |numeric|), floored
    verdict: str
    reason: str  # see results.report.Probe.reason
    _: KW_ONLY
    loss_noise: float = 0.0

    @property
    def rel_error(self) -> float:
        return abs(self.discrepancy) / self.scale if self.scale > 0 else 0.0


def _flat(stencil: Stencil, rtol: float, scale_floor: float) -> Assessment:
    analytic = stencil.analytic
    # the loss does not move and autograd says it should not, or only by float noise (a bias before BatchNorm)
    if abs(analytic) <= rtol * scale_floor:
        return Assessment(0.0, -analytic, 0.0, scale_floor, "ok", "agrees")
    # A float loss can be a staircase: a saturated cross-entropy computes log(1 + x) with 1 + x rounded to 1, so steps
    # that change the true loss by less than a rounding quantum change nothing. Its residuals are then exactly zero,
    # which says nothing about the noise: the probe has no information.
    return Assessment(0.0, -analytic, abs(analytic), max(abs(analytic), scale_floor), "inconclusive", "flat")


def _nonfinite(stencil: Stencil) -> Assessment:
    return Assessment(math.nan, math.nan, math.inf, abs(stencil.analytic), "inconclusive", "nonfinite")


def _quantum(stencil: Stencil, value_epsilon: float) -> float:
    """The rounding quantum of the loss values over the step: no probe is more precise than that."""
    return value_epsilon * max(abs(stencil.center), 1e-30) / stencil.step


def screen(stencil: Stencil, *, rtol: float, scale_floor: float, value_epsilon: float, loss_noise: float) -> Assessment:
    """Judge a two-point screen, whose noise is borrowed (``loss_noise``: the round-off of one loss evaluation as the
    check's full stencils measured it): agreement within ``rtol`` is "ok" when that noise resolves it, else
    "inconclusive"; a discrepancy beyond ``rtol`` is "suspect", for a full stencil to decide."""
    if not stencil.finite:
        return _nonfinite(stencil)
    if stencil.flat:
        return _flat(stencil, rtol, scale_floor)
    discrepancy = stencil.discrepancy(0)
    numeric = stencil.analytic + discrepancy
    noise = 2 * loss_noise / stencil.span() + _quantum(stencil, value_epsilon)
    scale = max(abs(stencil.analytic), abs(numeric), scale_floor)
    size = abs(discrepancy)
    if size <= rtol * scale:
        resolved = SIGNIFICANCE * noise <= RESOLUTION * scale
        verdict, reason = ("ok", "agrees") if resolved else ("inconclusive", "unresolved")
    else:
        # beyond the tolerance: significant or not by the borrowed estimate, only the probe's own stencil can tell
        # (a single coordinate is often far less noisy than the whole model moving at once)
        verdict, reason = "suspect", "discrepancy" if size > SIGNIFICANCE * noise else "unresolved"
    return Assessment(numeric, discrepancy, noise, scale, verdict, reason, loss_noise=noise * stencil.step)


def _fields(assessment: Assessment) -> tuple[float, float, float, float]:
    return assessment.numeric, assessment.discrepancy, assessment.noise, assessment.scale


def assess(
    stencil: Stencil, *, rtol: float, scale_floor: float, value_epsilon: float, jitter: float = 0.0
) -> Assessment:
    """Judge a full four-point stencil against the error it measures for itself: smaller discrepancies than ``rtol`` are
    accepted even when significant; ``scale_floor`` bounds the relative error's denominator from below (a derivative
    whose true value is zero does not read as a 100% error); the loss values' quantisation at ``value_epsilon`` (their
    dtype's) is the smallest error any probe can have; ``jitter``: how much two evaluations of the loss differ
    (non-deterministic kernels), in loss units."""
    analytic = stencil.analytic
    if not stencil.finite:
        return _nonfinite(stencil)
    if stencil.flat:
        return _flat(stencil, rtol, scale_floor)
    discrepancy = stencil.richardson
    numeric = analytic + discrepancy
    roughness = abs(stencil.even_residual) / stencil.step
    # E(h) - E(h/2) has ~0.8x, the fourth difference ~4.4x the round-off of the Richardson estimate (for independent
    # rounding errors); the odd residual also bounds what truncation is left. Jitter enters like round-off, through
    # the smaller pair (Richardson weighs it 4/3).
    noise = (
        1.2 * abs(stencil.odd_residual)
        + 0.25 * roughness
        + _quantum(stencil, value_epsilon)
        + 3 * jitter / stencil.span(1)
    )
    scale = max(abs(analytic), abs(numeric), scale_floor)
    size = abs(discrepancy)
    loss_noise = noise * stencil.step
    if size <= rtol * scale:
        resolved = SIGNIFICANCE * noise <= RESOLUTION * scale
        verdict, reason = ("ok", "agrees") if resolved else ("inconclusive", "unresolved")
    elif size <= SIGNIFICANCE * noise:
        verdict, reason = "inconclusive", "kink" if roughness > size else "unresolved"
    else:
        verdict, reason = "fail", "discrepancy"
    return Assessment(numeric, discrepancy, noise, scale, verdict, reason, loss_noise=loss_noise)


def undecided(assessment: Assessment, rtol: float) -> bool:
    """Whether an inconclusive result hides a discrepancy beyond the tolerance that noise or kinks kept from being
    resolved: worth measuring again with less noise."""
    return (
        assessment.verdict == "inconclusive"
        and assessment.reason in ("unresolved", "kink", "unstable")
        and assessment.rel_error > rtol
    )


def confirm(first: Assessment, second: Assessment) -> Assessment:
    """A first full stencil combined with an independent second one at a smaller step: the discrepancy stands only if
    the second finds it too, of the same size (within :data:`AGREEMENT`), as a wrong gradient is wrong by the same
    amount at any step while round-off and kinks do not reproduce; a second "ok" stands; anything else is inconclusive.
    """
    if second.verdict == "fail":
        spread = abs(first.discrepancy - second.discrepancy)
        if spread <= AGREEMENT * max(abs(first.discrepancy), abs(second.discrepancy)):
            return second
        return Assessment(*_fields(second)[:2], max(second.noise, spread), second.scale, "inconclusive", "unstable")
    if second.verdict == "ok":
        return second
    return Assessment(*_fields(second), "inconclusive", second.reason)
