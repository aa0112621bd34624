"""Whether the loss has a kink at the point along a probe's direction: the one-sided difference quotients of a full
stencil, at two steps.

At a tie (max-pool windows over an exactly constant background, ReLU at exactly zero, ``grid_sample`` with every
sample on the grid) the loss has a left and a right derivative that differ by an amount that does not shrink with the
step; at a smooth point they differ only by curvature, ``φ''·h``, which halves with the step. A discrepancy that a
shifted point does not reproduce is a tie only where such a kink is measured: a backward can be wrong exactly at a
special point of a smooth loss (a logit at 0, an exact zero factor of a product, a sample exactly on a border), and
a shift moves away from that point too.

That autograd's value lies between the one-sided derivatives at a tie holds for one kink, not for compositions of
them: on a LeNet over exactly constant backgrounds autograd lies far outside both (ReLU's zero derivative at 0 chosen
below a max-pool's first index), so only the shape of the jump is used.
"""

from __future__ import annotations

import sys
from typing import TypeGuard

from gradwatch.engine.numerics.assessment import SIGNIFICANCE
from gradwatch.engine.numerics.stencil import Stencil

SMOOTH_RATIO = (1.5, 2.5)
"""The range of the ratio of the one-sided jumps at ``h`` and ``h/2`` that marks a smooth point: curvature makes the
right and left difference quotients differ by about ``φ''·h`` (ratio 2), a kink by the same amount at any step (ratio
1), round-off by more at the smaller step. A discrepancy at a smooth point has no tie to explain it (see the module
doc)."""


def one_sided_jumps(stencil: Stencil) -> tuple[float, float]:
    """The right minus the left difference quotient of a full stencil, at ``h`` and at ``h/2``: about ``φ''·h`` and
    half that at a smooth point, the same amount at both steps at a kink (the jump of the slope)."""
    deviations = stencil.deviations()
    jumps = []
    for pair in (0, 1):
        plus, minus = stencil.points[2 * pair], stencil.points[2 * pair + 1]
        jumps.append(deviations[2 * pair] / plus.along - deviations[2 * pair + 1] / minus.along)
    return jumps[0], jumps[1]


def _measurable(stencil: Stencil | None) -> TypeGuard[Stencil]:
    return stencil is not None and stencil.full and stencil.finite and all(p.along != 0.0 for p in stencil.points)


def smooth_at_the_point(stencil: Stencil | None) -> bool:
    """Whether the loss is smooth at the point along the stencil's direction: the jump between the one-sided
    difference quotients halves with the step (:data:`SMOOTH_RATIO`), as curvature makes it, and is well above the
    stencil's round-off; at a tie (a kink at the point) it stays the same at both steps. A stencil that cannot tell
    (round-off, a partial stencil) counts as a tie."""
    if not _measurable(stencil):
        return False
    at_h, at_half = one_sided_jumps(stencil)
    noise = abs(stencil.odd_residual)
    if at_half == 0.0 or abs(at_half) <= 2 * SIGNIFICANCE * noise:
        return False
    low, high = SMOOTH_RATIO
    return low <= at_h / at_half <= high


TIE_RATIO = (0.6, 1.6)
"""The range of the ratio of the one-sided jumps at ``h`` and ``h/2`` that marks a kink at the point (a jump of the
slope that does not shrink with the step, ratio 1), where :func:`at_a_tie` says so."""


def at_a_tie(stencil: Stencil | None, value_epsilon: float = sys.float_info.epsilon) -> bool:
    """Whether the stencil shows a kink at the point itself: a full stencil whose one-sided difference quotients differ
    by about the same significant amount at ``h`` and at ``h/2`` (:data:`TIE_RATIO`). Unlike
    :func:`smooth_at_the_point`, a stencil that cannot tell is no tie: only a measured kink is.

    Significant means beyond the stencil's odd residual and beyond what rounding the loss values to ``value_epsilon``
    alone makes of each jump (:func:`jump_rounding`): on a loss that is nearly linear along the probe, the jumps are a
    few ulps of the loss over the step, the same at both steps by chance, and a wrong gradient there (say one scaled
    by 1.5) would otherwise read as a tie."""
    if not _measurable(stencil):
        return False
    at_h, at_half = one_sided_jumps(stencil)
    noise = abs(stencil.odd_residual)
    for pair, jump in enumerate((at_h, at_half)):
        if jump == 0.0 or abs(jump) <= 2 * SIGNIFICANCE * (noise + jump_rounding(stencil, pair, value_epsilon)):
            return False
    low, high = TIE_RATIO
    return low <= at_h / at_half <= high


def jump_rounding(stencil: Stencil, pair: int, value_epsilon: float) -> float:
    """The error that rounding each loss value to ``value_epsilon`` puts into the one-sided jump of ``pair``
    (``±h`` or ``±h/2``): the jump is ``(φ(s) + φ(−s) − 2·φ(0)) / s`` less autograd's share, so half an ulp of each
    of the four values it adds, over the step."""
    plus, minus = stencil.points[2 * pair], stencil.points[2 * pair + 1]
    values = abs(plus.value) + abs(minus.value) + 2 * abs(stencil.center)
    return 0.5 * value_epsilon * values / min(abs(plus.along), abs(minus.along))
