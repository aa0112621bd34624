"""The verdict of an applied check, calibrated to the precision of the training's path.

A probe moves the parameters along a unit direction ``d`` and measures the window loss's derivative ``D`` by central
differences (float64 storage, or float64 reductions), with the stencil's own error ``n``
(:mod:`gradwatch.engine.numerics.assessment`). The applied gradient predicts ``a = g·d``. A correct gradient of the
path differs from the exact derivative by its rounding, which is measured, not assumed (:func:`floors`), per tensor
``T``, as the largest of:

* the **forward's and formulas' rounding**: the distance ``‖g_lo,T − g_hi,T‖`` between a trusted gradient in the
  path's precision and a more precise one (16-bit autocast emulated, :mod:`.gradients`, against float32; float32
  against float64);
* on a 16-bit path, the **backward kernels' own rounding** (a 16-bit reduction inside a norm's backward, which no
  emulation reproduces): the spread ``‖g_1,T − g_3,T / 3‖`` between the path's gradient of the loss and of three times
  the loss, which the same kernels round otherwise (a fault that scales a gradient cancels out of it);
* the rounding of storing the gradient in the path's dtype, ``u · ‖g_T‖``.

By Cauchy-Schwarz a gradient that far off errs by at most that along any unit direction within ``T``. The applied
gradient fails along ``d`` when ``|a − D|`` exceeds :data:`FLOOR_MULTIPLE` times the floor along ``d`` plus
:data:`~gradwatch.engine.numerics.assessment.SIGNIFICANCE` times ``n``, and the discrepancy reproduces at an independent
second step. The multiple is ``torch.compile``'s accuracy rule (an optimized gradient may be 2x, in 16 bits 3x, as far
from float64 as eager's), the same spirit as flash-attention's "at most 2x the error of a same-precision reference".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gradwatch.engine.distributed import collective
from gradwatch.engine.measuring.points import Measurements
from gradwatch.engine.numerics.assessment import AGREEMENT, RESOLUTION, SIGNIFICANCE, Assessment, assess, screen
from gradwatch.engine.numerics.kinks import at_a_tie
from gradwatch.engine.numerics.norms import CHUNK_ELEMENTS, float64_chunks, norms
from gradwatch.engine.numerics.stencil import Stencil
from gradwatch.engine.numerics.steps import machine_epsilon
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.results.kinds import ProbeKind
from gradwatch.engine.results.report import Probe

if TYPE_CHECKING:
    from gradwatch.engine.applied.window_points import WindowMeasurements

FLOOR_MULTIPLE = {torch.float32: 2.0, torch.float64: 2.0, torch.float16: 3.0, torch.bfloat16: 3.0}
"""How many times its noise floor an applied gradient may be off (``torch._dynamo.utils.same``'s multiple: 2 in
float32, 3 in float16 and bfloat16)."""


def floor_multiple(dtype: torch.dtype) -> float:
    return FLOOR_MULTIPLE.get(dtype, 3.0)


def storage_rounding(dtype: torch.dtype) -> float:
    """The unit roundoff of ``dtype``: no gradient stored in it is relatively closer to the derivative."""
    return machine_epsilon(dtype) / 2


SPREAD_SCALE = 3.0
"""The loss factor of the spread measurement: not a power of two, so that every rounding of the backward changes."""


def distances(a: Sequence[Tensor], b: Sequence[Tensor]) -> list[float]:
    """``‖a_T − b_T‖`` per tensor, accumulated in float64. Gradients of float32 or less are subtracted in float32 (exact
    within a factor of two of each other, as compared gradients are): no float64 copy, which a GPU may not hold; one
    difference at a time (sharded: all at once, their squares summed over the ranks together)."""
    if collective.active() is not None:
        return norms([_difference(x, y) for x, y in zip(a, b, strict=True)], exact=True)
    return [norms([_difference(x, y, chunked=True)], exact=True)[0] for x, y in zip(a, b, strict=True)]


def _difference(x: Tensor, y: Tensor, *, chunked: bool = False) -> Tensor:
    """``x − y`` in float32 at least; ``chunked``, for a large float32 difference, already in the float64 copy its
    float64 norm makes (:data:`~gradwatch.engine.numerics.norms.CHUNK_ELEMENTS` at a time: elementwise, so the norm's
    bits are the same), so that 2x a tensor is alive, not 3x."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
    x, y = x.detach(), y.detach()
    large = x.numel() > CHUNK_ELEMENTS and x.shape == y.shape and x.is_contiguous() and y.is_contiguous()
    if not (chunked and large and dtype == torch.float32 and type(x) is Tensor and type(y) is Tensor):
        return x.to(dtype) - y.to(dtype)
    return float64_chunks([x, y], lambda out, p, q: out.copy_(p.to(dtype) - q.to(dtype)))


def floors(measured: Sequence[Sequence[float]], applied_norms: Sequence[float], dtype: torch.dtype) -> list[float]:
    """Per tensor, the noise floor of a correct gradient on a path computing in ``dtype``: the largest of the
    ``measured`` distances (see the module doc) and the storage rounding."""
    rounding = storage_rounding(dtype)
    return [max([rounding * a, *(m[i] for m in measured)]) for i, a in enumerate(applied_norms)]


FINER_STEPS = 10.0
"""How much finer than :func:`~gradwatch.engine.numerics.steps.relative_step` a float64 probe of a lower-precision
gradient may step (:func:`float64_step`)."""

NOISE_SHARE = 0.25
"""... as long as its assumed round-off, :data:`~gradwatch.engine.numerics.assessment.SIGNIFICANCE` times over, stays
within this share of the tolerance's floor part at the storage rounding (a lower bound of any floor of the path)."""


def float64_step(step: float, least: float, rounding: float) -> float:
    """The step of a float64 probe of a lower-precision gradient: ``step`` (``ε^(1/3)``) made up to
    :data:`FINER_STEPS` times finer while the screen's assumed noise ``rounding / h`` (one evaluation's assumed
    round-off plus its quantum) stays within :data:`NOISE_SHARE` of ``least``, the tolerance's floor part at the
    storage rounding (``multiple · u · Σ_T w_T ‖g_T‖²`` along ``Σ_T w_T g_T``). A large model crosses many ReLU kinks at
    ``ε^(1/3)``, whose error shrinks with the step: a 26M GPT's screens read up to 1e-6 of ``‖g‖`` off there, ten times
    its float32 floor, 2e-8 at a tenth of the step."""
    if not step > 0 or not rounding > 0 or not math.isfinite(least):
        return step
    room = NOISE_SHARE * least / (SIGNIFICANCE * rounding / step)
    return step / min(max(room, 1.0), FINER_STEPS)


@dataclass(frozen=True, kw_only=True)
class Judged(Assessment):
    """A stencil's measurement judged against the path's floor (:func:`judge`), with the tolerance it was held against
    and its ``excess`` over it (above 1 fails)."""

    tolerance: float = math.nan
    excess: float = math.nan


def judge(assessment: Assessment, stencil: Stencil, floor: float, multiple: float) -> Judged:
    def judged(verdict: str, reason: str, tolerance: float, excess: float) -> Judged:
        fields = (assessment.numeric, assessment.discrepancy, assessment.noise, assessment.scale)
        return Judged(*fields, verdict, reason, loss_noise=assessment.loss_noise, tolerance=tolerance, excess=excess)

    if not stencil.finite:
        return judged("inconclusive", "nonfinite", math.inf, math.nan)
    if stencil.flat:
        # the loss did not move at all: only a derivative within the path's floor agrees with that (a flat stencil's
        # noise is the derivative itself, "no information": counted, it would let any derivative agree)
        tolerance = multiple * floor
        size = abs(stencil.analytic)
        if size <= tolerance:
            return judged("ok", "agrees", tolerance, size / tolerance if tolerance else 0.0)
        return judged("inconclusive", "flat", tolerance, math.nan)
    tolerance = multiple * floor + SIGNIFICANCE * assessment.noise
    size = abs(assessment.discrepancy)
    excess = size / tolerance if tolerance > 0 else math.inf
    if size > tolerance:
        return judged("fail", "discrepancy", tolerance, excess)
    if not resolves(assessment, stencil):
        return judged("inconclusive", "unresolved", tolerance, excess)
    return judged("ok", "agrees", tolerance, excess)


def resolves(assessment: Assessment, stencil: Stencil) -> bool:
    """Whether a probe's noise, :data:`SIGNIFICANCE` times over, is within
    :data:`~gradwatch.engine.numerics.assessment.RESOLUTION` of its slope (as for a recomputed probe's ``"ok"``): one
    whose noise is comparable to the slope (a loss rounded to float32 on the way) "agrees" with a 50% wrong gradient."""
    scale = max(abs(stencil.analytic), abs(assessment.numeric))
    return SIGNIFICANCE * assessment.noise <= RESOLUTION * scale


def confirmed(first: Judged, second: Judged) -> bool:
    """Whether a failure stands at an independent second step: it fails there by the same amount (within
    :data:`~gradwatch.engine.numerics.assessment.AGREEMENT`); kinks and round-off do not reproduce."""
    if first.verdict != "fail" or second.verdict != "fail":
        return False
    spread = abs(first.discrepancy - second.discrepancy)
    return spread <= AGREEMENT * max(abs(first.discrepancy), abs(second.discrepancy))


def relative_floor(descent: Probe | None) -> float:
    """The path's noise floor along the descent probe relative to ``‖g‖`` (``nan`` without one)."""
    if descent is None or descent.floor is None or not descent.analytic:
        return math.nan
    return descent.floor / descent.analytic


class FloorJudge:
    """The applied check's judge for the ladder (:class:`~gradwatch.engine.probing.ladder.Judge`): each probe against
    ``multiple`` times the path's floor along its direction (``task.floor``) plus its own noise (:func:`judge`).

    A screen borrows ``measurements.loss_noise``, the round-off of one loss evaluation (assumed in float64, measured
    natively by the descent probe's first full stencil). ``provisional``: the floors are a lower bound
    (:mod:`.measurement`), and a screen that does not agree is not completed. A failure stands only where it
    reproduces at the second step (:func:`confirmed`) at no tie of the loss; no undecided probe is measured again."""

    def __init__(self, measurements: WindowMeasurements, multiple: float, *, provisional: bool) -> None:
        self.measurements = measurements
        self.multiple = multiple
        self.provisional = provisional

    def screen(self, task: ProbeTask, stencil: Stencil, measurements: Measurements, loss_noise: float) -> Assessment:
        assessment = screen(stencil, rtol=0.0, scale_floor=task.scale_floor, value_epsilon=measurements.value_epsilon,
                            loss_noise=self.measurements.loss_noise)  # fmt: skip
        found = judge(assessment, stencil, task.floor, self.multiple)
        if found.verdict == "ok" or self.provisional:
            return found
        return dataclasses.replace(found, verdict="suspect")

    def assess(self, task: ProbeTask, stencil: Stencil, measurements: Measurements) -> Assessment:
        assessment = assess(stencil, rtol=0.0, scale_floor=task.scale_floor, value_epsilon=measurements.value_epsilon)
        if task.kind == ProbeKind.DESCENT and stencil.finite and not math.isfinite(self.measurements.loss_noise):
            self.measurements.loss_noise = assessment.loss_noise  # the noise the other probes' screens borrow
        return judge(assessment, stencil, task.floor, self.multiple)

    def confirm(self, task: ProbeTask, first: Assessment, second: Stencil, measurements: Measurements) -> Assessment:
        assert isinstance(first, Judged)
        assert task.stencil is not None
        again = self.assess(task, second, measurements)
        assert isinstance(again, Judged)
        epsilon = measurements.value_epsilon
        if not confirmed(first, again):
            ok = again.verdict == "ok"
            return dataclasses.replace(
                again, verdict="ok" if ok else "inconclusive", reason="agrees" if ok else "unstable"
            )
        if at_a_tie(task.stencil, epsilon) or at_a_tie(second, epsilon):
            # a kink at the point (a ReLU input or a max-pool window exactly tied): the loss has no derivative along
            # the probe, the central difference is the mean of its one-sided slopes at any step (so the discrepancy
            # reproduces) and autograd's choice of one side is no wrong formula
            return dataclasses.replace(again, verdict="inconclusive", reason="tie")
        return again

    def undecided(self, task: ProbeTask, result: Assessment) -> bool:
        return False
