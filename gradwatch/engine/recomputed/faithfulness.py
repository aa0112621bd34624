"""Whether float64 probes of a lower-precision model measured the model's own function.

:class:`~gradwatch.engine.function.fidelity.Float64Fidelity` keeps the casts and random draws that PyTorch dispatches
faithful, but a loss can still compute another function on float64 storage: a branch on ``x.dtype``, a round trip
through NumPy in float32, an extension kernel that computes in float32 whatever it is given, random draws that do not
go through torch. Such a float64 evaluation gives away what it is:

* **its centre is not the reference loss** beyond the rounding of the native loss, while a native evaluation is
  (:class:`UnfaithfulFloat64Error`, raised where the centre is reproduced);
* **it is quantised**: when float64 probes could not decide (a probe read a flat loss, or round-off or kinks hid what
  it measured), the loss is measured along the gradient at steps whose predicted change is :data:`FINE_CHANGE` of the
  loss, far above float64's resolution and far below float32's (:func:`quantised`). A float64 function follows its
  slope there; a function rounded to float32 on the way moves by whole float32 ulps or not at all. (A probe's flat
  loss alone says nothing: a straight-through quantiser's weight is flat in float64 too, by design, while the loss
  along the whole gradient still moves smoothly.)

Either way the check probes again in the native precision, with a note; it never reports what the float64 function
said. A healthy check, whose float64 probes all decide, pays for none of it. A third sign, float64 autograd agreeing
with the float64 finite difference while the native gradient does not, is settled where it arises:
:func:`gradwatch.engine.recomputed.confirmation.confirm_precision` measures such a probe natively.
"""

from __future__ import annotations

from collections.abc import Sequence

from gradwatch.engine.measuring.points import Measurements
from gradwatch.engine.numerics.stencil import HALF_OFFSETS, PAIR_OFFSETS
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.errors import UnfaithfulFloat64Error as UnfaithfulFloat64Error

FINE_CHANGE = 1e-9
"""The loss change, relative to the loss, of the steps :func:`quantised` takes: 10⁷ float64 ulps, 1/60 of a float32
ulp."""

FINE_AGREEMENT = 1e-2
"""How far apart the central differences at the fine step and at half of it may be, relative to the slope, before the
loss counts as quantised: a float64 function's round-off there is ~1e-7 of the slope."""

UNDECIDED = ("flat", "unresolved", "kink")
"""The reasons of undecided float64 probes that make a check test whether the float64 loss is quantised."""


def quantised(tasks: Sequence[ProbeTask], measurements: Measurements, loss: float) -> str | None:
    """Why the float64 loss is quantised, or ``None`` if it is not or no probe of ``tasks`` was left undecided (see
    the module doc). Measures the loss at 4 points along the first probe's direction (the descent direction)."""
    if not any(task.result is not None and task.result.reason in UNDECIDED for task in tasks) or not tasks:
        return None
    direction = tasks[0].direction
    if direction.analytic == 0.0 or loss == 0.0:
        return None
    step = FINE_CHANGE * abs(loss) / abs(direction.analytic)
    stencil = measurements.stencil(direction, step, PAIR_OFFSETS + HALF_OFFSETS)
    if not stencil.finite:
        return None
    if stencil.flat or abs(stencil.odd_residual) > FINE_AGREEMENT * abs(direction.analytic):
        moved = [point.value - stencil.center for point in stencil.points[:2]]
        return (
            f"along the gradient, steps predicted to move it by ±{abs(stencil.points[0].predicted):.2g} moved it by "
            f"{moved[0]:+.2g} and {moved[1]:+.2g}: somewhere it is computed in a lower precision that gradwatch cannot "
            "promote"
        )
    return None
