"""Steps and tolerances: how far a probe moves, and how close analytic and numeric derivatives must agree, by dtype.

Finite differences lose about half the digits of the dtype they are computed in, and autograd's own gradient carries
the rounding of the dtype it was computed in. Every number here follows from those two facts (see
``docs/guide.md`` and the notes on numerics): the step that balances truncation against round-off, the relative
tolerance above autograd's rounding, and how far the loss at the unperturbed point may drift between evaluations.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def machine_epsilon(dtype: torch.dtype) -> float:
    """The machine epsilon of a floating dtype."""
    return float(torch.finfo(dtype).eps)


def least_precise(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype of largest machine epsilon among ``dtypes`` (float32 if there is none): the precision a check's
    tolerance and steps must allow for."""
    return max(dtypes, key=machine_epsilon, default=torch.float32)


def most_precise(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype of smallest machine epsilon among ``dtypes`` (float32 if none)."""
    return min(dtypes, key=machine_epsilon, default=torch.float32)


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
    """``rtol``, raised to what autograd's rounding in ``dtype`` allows for a loss of this size
    (:data:`ANALYTIC_ROUNDING`); for a loss of exactly zero ``rtol`` itself: it is not the memorised sample's ``1 - p``
    (where ``p`` rounds to 1 its gradient rounds to exactly zero too), and an empty batch or a loss crossing zero has a
    gradient as precise as any other."""
    if loss == 0.0:
        return rtol
    return max(rtol, ANALYTIC_ROUNDING * machine_epsilon(dtype) / abs(loss))


SIXTEEN_BIT_DIRECTION_STEP = 2.0
"""How much longer a probe along a direction over many coordinates steps in a 16-bit dtype. Its step is relative to
the coordinates' magnitude, yet moves each of ``n`` coordinates by about ``1/√n`` of it, so that the 16-bit round-off
``ε·|L|/h`` of its differences is nearly all its noise, while the stencil also counts the two-point truncation
``O(h²)`` as noise. Measured on a pure-bf16 residual MLP (30 checks): along ``ĝ`` the noise was 1.5% of the slope at
1x (round-off), 1.6% at 4x (truncation), about 0.9% at 2x, the balance of the two; the checks decided (``ok``) rose
from 17 to 29 of 30 at 2x (25 at 3x, 21 at 4x), and from 14 and 17 to 24 and 27 of 30 at two other seeds."""


def relative_step(dtype: torch.dtype, gradient_dtype: torch.dtype | None = None, *, direction: bool = False) -> float:
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

    A ``direction`` over many coordinates evaluated in a 16-bit dtype steps :data:`SIXTEEN_BIT_DIRECTION_STEP` times
    longer: its round-off, not its truncation, limits it.
    """
    epsilon = machine_epsilon(dtype)
    if gradient_dtype is not None and machine_epsilon(gradient_dtype) > epsilon:
        return epsilon ** (1 / 3)
    longer = direction and epsilon > machine_epsilon(torch.float32)
    return epsilon**0.2 * (SIXTEEN_BIT_DIRECTION_STEP if longer else 1.0)


def finer_step(step: float, *, center: float, scale: float, rtol: float, compute_epsilon: float) -> float | None:
    """The step to measure an undecided probe again at: as small as :data:`FINER_STEP` allows, but not where round-off
    of values computed with ``compute_epsilon`` would approach ``rtol · scale`` (with :data:`ROUNDOFF_MARGIN`); ``None``
    if that leaves no room below ``step`` (in float32 often: what the float64 re-measurement is for)."""
    finest = ROUNDOFF_MARGIN * compute_epsilon * max(abs(center), 1e-30) / (rtol * scale) if scale > 0 else math.inf
    finer = max(step * FINER_STEP, finest)
    return finer if finer <= step / 2 else None


REPRODUCIBILITY_TOLERANCE = 1e-4
"""Relative difference allowed between the reference loss and a gradient-free evaluation at the same point (more for
16-bit models, whose own rounding is larger). Larger means the evaluations do not compute the same function (random
draws that cannot be replayed, or kernels that differ with and without autograd), and finite differences would not be
comparable with autograd."""

FLOAT64_AGREEMENT = 1e-2
"""Relative difference allowed between the reference loss and the same loss evaluated on float64 storage. Float rounding
accounts for far less; more means the float64 evaluation is not the same function (randomness that was not replayed);
smaller differences of that kind cannot produce a failure either, as they do not reproduce at a second step."""


def center_tolerance(loss: float, native_dtype: torch.dtype, compute_dtype: torch.dtype) -> float:
    """How far the loss at the unperturbed point, evaluated in ``compute_dtype``, may be from the reference ``loss``
    autograd computed in ``native_dtype``, in loss units: in the same dtype by little more than rounding; in float64 by
    the reference's whole rounding error, for a loss near zero (a memorised sample's cross-entropy, 3e-4) about its
    float32 epsilon in absolute terms."""
    native_epsilon = machine_epsilon(native_dtype)
    loss = abs(loss)
    if compute_dtype == native_dtype:
        return max(REPRODUCIBILITY_TOLERANCE, 8 * native_epsilon) * loss + 1e-30
    absolute = 64 * min(native_epsilon, machine_epsilon(torch.float32))
    return max(FLOAT64_AGREEMENT, 8 * native_epsilon) * loss + absolute
