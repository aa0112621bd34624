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

import torch


def machine_epsilon(dtype: torch.dtype) -> float:
    """The machine epsilon of a floating dtype."""
    return float(torch.finfo(dtype).eps)


@dataclass(frozen=True)
class Point:
    """One evaluation of a probe: the loss at nominal offset ``offset × h`` along the direction.

    Attributes:
        offset: The nominal position in units of the step ``h`` (``±1`` or ``±0.5``).
        value: The loss there.
        along: The displacement actually obtained along the direction.
        predicted: Autograd's first-order prediction ``g·δ`` of the loss change for that displacement.
    """

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
    """The loss along one direction at ``±h`` (a screen) or at ``±h`` and ``±h/2`` (a full stencil).

    Attributes:
        step: The nominal step ``h``.
        center: The loss at the origin.
        analytic: Autograd's derivative along the direction.
        points: The evaluations, ``±h`` first.
    """

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

FINER_STEP = 1 / 64
"""A probe along a whole direction whose stencil could not decide (it crossed kinks: ReLU units or max-pool winners
changing sides, or its round-off hid the discrepancy) measures again at up to ``h / 64``: a kink's error grows with
the number of units the step crosses, which shrinks with ``h``. See :func:`finer_step`."""

ROUNDOFF_MARGIN = 20.0
"""How far the round-off of a finer step's stencil (about ``ε·|L| / h`` in derivative units, for values computed with
machine epsilon ``ε``) stays below the tolerance it must resolve."""

_RELATIVE_TOLERANCE = {
    torch.float64: 1e-7,
    torch.float32: 5e-4,
    torch.float16: 3e-2,
    torch.bfloat16: 1e-1,
}


def relative_tolerance(dtype: torch.dtype) -> float:
    """The default relative tolerance for gradients computed in ``dtype``.

    Above float rounding of the analytic gradient itself (float32 autograd is ~1e-5 off the exact derivative on large
    summed losses, up to ~2e-4 on a model that memorised its data) and below the smallest errors that must be caught
    (1e-3 in float32, 1e-6 in float64). 16-bit gradients carry errors of ~1e-2 of their own: only gross errors can be
    told from them.
    """
    return _RELATIVE_TOLERANCE.get(dtype, 5e-4)


ANALYTIC_ROUNDING = 4.0
"""Autograd's own relative error grows as the loss nears zero: a memorised sample's cross-entropy ``L ≈ 1 − p`` has the
gradient ``p − 1``, computed with an absolute error of ``ε``, so a relative error of ``ε / L``. Measured on float32
cross-entropy down to ``L = 3e-6``: at most ``1.1 · ε / L``. The tolerance is at least this many times ``ε / |L|``."""

UNCHECKABLE_TOLERANCE = 0.05
"""When rounding alone forces a tolerance above this (a float32 loss below ~1e-5), a check cannot tell a 5% error
from rounding and makes no probe."""


def gradient_tolerance(rtol: float, loss: float, dtype: torch.dtype) -> float:
    """``rtol``, raised to what autograd's rounding in ``dtype`` allows for a loss of this size (see
    :data:`ANALYTIC_ROUNDING`); infinite for a zero loss."""
    if loss == 0.0:
        return math.inf
    return max(rtol, ANALYTIC_ROUNDING * machine_epsilon(dtype) / abs(loss))


def relative_step(dtype: torch.dtype, gradient_dtype: torch.dtype | None = None) -> float:
    """Step size relative to the scale of the perturbed value, for probes evaluated in ``dtype`` of a gradient computed
    in ``gradient_dtype`` (by default the same).

    In the gradient's own dtype: ``ε^(1/5)`` (0.041 in float32, 7.4e-4 in float64), the optimum for a
    Richardson-extrapolated central difference (truncation ``O(h⁴)``, round-off ``O(ε/h)``), as the tolerance is then
    close to what round-off allows.

    In a more precise dtype than the gradient's (float64 probes of a float32 model): ``ε^(1/3)`` (6.1e-6 in float64),
    the optimum of the two-point central difference that screens most probes (truncation ``O(h²)``). The tolerance
    then follows the gradient's dtype and is orders of magnitude above the round-off at this step, while the smaller
    step leaves a screen ~10⁴ times less truncation and crosses ~100 times fewer kinks (ReLU, max-pool), so healthy
    probes rarely need the full stencil.
    """
    epsilon = machine_epsilon(dtype)
    if gradient_dtype is not None and machine_epsilon(gradient_dtype) > epsilon:
        return epsilon ** (1 / 3)
    return epsilon**0.2


@dataclass(frozen=True)
class Assessment:
    """What one stencil says about one derivative.

    Attributes:
        numeric: The finite-difference derivative.
        discrepancy: ``numeric − analytic``.
        noise: The estimated error of ``numeric`` (round-off, truncation, jitter), in derivative units.
        scale: The denominator of the relative error: ``max(|analytic|, |numeric|)``, floored.
        verdict: ``"ok"``, ``"fail"``, ``"inconclusive"``, or ``"suspect"`` for a screen that needs the full stencil.
            A ``"fail"`` here is a candidate until confirmed.
        reason: See :attr:`gradwatch.report.Probe.reason`.
        loss_noise: ``noise`` in loss units (times the step): what other probes of the check may borrow as the
            round-off of one loss evaluation.
    """

    numeric: float
    discrepancy: float
    noise: float
    scale: float
    verdict: str
    reason: str
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
    """Judge a two-point screen, whose noise is not measured but borrowed: ``loss_noise`` is the round-off of one loss
    evaluation as the check's full stencils measured it.

    Agreement within ``rtol`` is "ok" when the borrowed noise resolves it, "inconclusive" otherwise; a discrepancy
    beyond ``rtol`` is "suspect" and must be measured with a full stencil before anything is concluded from it.
    """
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
    return Assessment(numeric, discrepancy, noise, scale, verdict, reason, noise * stencil.step)


def _fields(assessment: Assessment) -> tuple[float, float, float, float]:
    return assessment.numeric, assessment.discrepancy, assessment.noise, assessment.scale


def assess(
    stencil: Stencil, *, rtol: float, scale_floor: float, value_epsilon: float, jitter: float = 0.0
) -> Assessment:
    """Judge a full four-point stencil, against the error it measures for itself.

    Args:
        stencil: The loss values of the probe.
        rtol: Relative tolerance: smaller discrepancies are accepted even when significant.
        scale_floor: Lower bound of the relative error's denominator, so that a derivative whose true value is zero
            does not read as a 100% error.
        value_epsilon: Machine epsilon of the dtype the loss values were delivered in; their quantisation is the
            smallest error any probe can have.
        jitter: How much two evaluations of the same loss differ (non-deterministic kernels), in loss units.
    """
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
    return Assessment(numeric, discrepancy, noise, scale, verdict, reason, loss_noise)


def finer_step(step: float, *, center: float, scale: float, rtol: float, compute_epsilon: float) -> float | None:
    """The step to measure an undecided probe again at, or ``None`` if round-off leaves no room below ``step``.

    As small as :data:`FINER_STEP` allows, but no smaller than where round-off of values computed with
    ``compute_epsilon`` would approach ``rtol · scale`` (with :data:`ROUNDOFF_MARGIN`). In float64 there is room for
    the full ``h / 64``; in float32 often little or none, which is what the float64 re-measurement is for.
    """
    finest = ROUNDOFF_MARGIN * compute_epsilon * max(abs(center), 1e-30) / (rtol * scale) if scale > 0 else math.inf
    finer = max(step * FINER_STEP, finest)
    return finer if finer <= step / 2 else None


def undecided(assessment: Assessment, rtol: float) -> bool:
    """Whether an inconclusive result hides a discrepancy beyond the tolerance that noise or kinks kept from being
    resolved: worth measuring again with less noise."""
    return (
        assessment.verdict == "inconclusive"
        and assessment.reason in ("unresolved", "kink", "unstable")
        and assessment.rel_error > rtol
    )


def confirm(first: Assessment, second: Assessment) -> Assessment:
    """Combine a first full stencil with an independent second one at a smaller step.

    The discrepancy stands only if the second stencil finds it too, of the same size (within :data:`AGREEMENT`): a wrong
    gradient is wrong by the same amount at any step, while round-off and kinks are not reproducible. If the second
    stencil agrees with autograd instead, its "ok" stands; anything else is inconclusive.
    """
    if second.verdict == "fail":
        spread = abs(first.discrepancy - second.discrepancy)
        if spread <= AGREEMENT * max(abs(first.discrepancy), abs(second.discrepancy)):
            return second
        return Assessment(*_fields(second)[:2], max(second.noise, spread), second.scale, "inconclusive", "unstable")
    if second.verdict == "ok":
        return second
    return Assessment(*_fields(second), "inconclusive", second.reason)
