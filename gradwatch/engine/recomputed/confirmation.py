"""Before a probe fails: the two confirmations that tell a wrong backward from a point where the loss has no
derivative, and from the rounding of a correct formula. A discrepancy the ladder confirmed at a second step along the
same line can still be no bug:

* **A kink exactly at the point** (a tie), where a central difference does not measure autograd's choice of one-sided
  derivative: :func:`gradwatch.engine.recomputed.shifted.confirm_at_a_shifted_point` measures the failure again away
  from it.
* **Float32 rounding of a correct formula.** Float64 probes of a float32 model compare the float32 gradient with the
  derivative of the float64 function. Where float32 rounds a correct formula beyond the tolerance (an ill-conditioned op
  such as ``logcumsumexp`` over a large loss, or a near-tie that float32 breaks the other way than float64),
  :func:`confirm_precision` computes the gradient in float64 along the same direction: if float64 autograd agrees with
  the float64 finite difference, the formula is right in float64. The probe is then measured once more natively: if
  the native gradient agrees with the native finite difference, float64 computed another function and the native
  verdict counts. Otherwise (a native finite difference of an ill-conditioned float32 loss is no more reliable than its
  gradient) the error's size decides, against the norm of the gradient over what the probe moves (a random direction's
  small slope would inflate it): beyond :data:`IMPRECISION_LIMIT` times the tolerance the backward is wrong in the
  native dtype only (a kernel specialised by dtype) and the failure stands; within it the probe ends ``ok`` with reason
  ``"imprecise"`` (``fail_on_imprecise=True`` fails it), its ``rel_error`` the precision lost.

Both run only on probes that failed, so a healthy check pays nothing for them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from gradwatch.engine.function.complex_params import autograd_tensor, with_parameter_hooks
from gradwatch.engine.function.evaluation import LossEvaluator, Reference
from gradwatch.engine.function.precision import float64_storage, substitute_of
from gradwatch.engine.measuring.directions import VectorDirection
from gradwatch.engine.measuring.points import Measurements
from gradwatch.engine.numerics.assessment import SIGNIFICANCE, Assessment
from gradwatch.engine.numerics.steps import relative_step, relative_tolerance
from gradwatch.engine.probing.plan import ProbePlan
from gradwatch.engine.probing.portfolio import Portfolio
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.recomputed.reference import reproduced_center
from gradwatch.engine.results.notes import Note, NoteCode

IMPRECISION_LIMIT = 10.0
"""The most a native gradient whose float64 formula is right may be off, in multiples of the tolerance, to pass for
rounding (5e-3 for float32): more than float32 rounding of a sane computation reaches (``logcumsumexp`` over values
near 1e4: 9e-4; TF32 matmuls: ~1e-3), less than the smallest bug a check must catch (1%)."""


def _vector_error(task: ProbeTask, result: Assessment, portfolio: Portfolio) -> float:
    """The probe's discrepancy relative to the norm of the gradient over what it moves: a bound on the relative error
    of that gradient as a vector. Float32 rounding of an ill-conditioned formula errs by some fraction of the gradient
    in every direction; along a direction nearly orthogonal to the gradient (a random one) the slope is small, and the
    same error would read as a much larger relative error of the slope."""
    params = [i for i in task.moves if isinstance(i, int)]
    if len(params) != len(task.moves) or not params:
        return result.rel_error
    if isinstance(task.direction, VectorDirection) and task.direction.weights is not None:
        return result.rel_error  # a cover probe's scale already is the size of its tensors' contributions
    size = math.sqrt(sum(portfolio.tensor_grad_norms[i] ** 2 for i in params))
    return min(result.rel_error, abs(result.discrepancy) / size) if size > 0 else result.rel_error


def confirm_precision(
    evaluator: LossEvaluator, portfolio: Portfolio, tasks: Sequence[ProbeTask], plan: ProbePlan
) -> None:
    """For the failing tasks of a model whose gradient is less precise than float64: the float64 gradient along each
    task's direction (one float64 forward and backward for all of them). Where it agrees with the float64 numeric the
    formula is right in float64; a native measurement and the size of the error then decide between another float64
    function, a backward wrong in the native dtype only and rounding (see the module doc). ``evaluator`` must be on
    the native parameters and inputs."""
    native_dtype, fail_on_imprecise = plan.native_dtype, plan.fail_on_imprecise
    failing = [task for task in tasks if task.failed and not task.missing]
    if not failing or native_dtype == torch.float64:
        return
    native_params = evaluator.params
    with float64_storage(evaluator.model) as substitutes:
        # float64 copies to differentiate: leaves of their own, so the parameters' accumulators never see them
        for _, p in native_params:
            substitutes.get(id(autograd_tensor(p)), p).requires_grad_()
        evaluator.params = [(name, substitute_of(p, substitutes)) for name, p in native_params]
        evaluator.use_float64_inputs()
        try:
            reference = evaluator.reference(with_inputs=any(task.kind.traits.moves_inputs for task in failing))
            precise = hooked_reference(reference, native_params)
            analytic = [portfolio.replica(task, evaluator, precise).direction.analytic for task in failing]
        finally:
            evaluator.params = native_params
            evaluator.use_native_inputs()
    formula_right = [task for task, value in zip(failing, analytic, strict=True) if _agrees(task, value)]
    # a 16-bit gradient judged against its measured floor: native 16-bit finite differences resolve nothing near that
    # floor (a loss quantised at 8e-3 of itself in bf16), and a lucky "ok" there would pass a 16-bit kernel's bug off as
    # float64 evaluating another function; the float64 function was verified to be the model's before probing
    natively = [None] * len(failing) if plan.measured_floor else _measured_natively(evaluator, portfolio, failing, plan)
    # a measured 16-bit tolerance already is the rounding of a correct gradient: beyond it, more than rounding
    multiple = 1.0 if plan.measured_floor else IMPRECISION_LIMIT
    limit = 0.0
    right: list[str] = []
    unreproduced: list[str] = []
    rest: list[tuple[ProbeTask, Assessment | None]] = []
    for task, native in zip(failing, natively, strict=True):
        if native is not None and native.verdict == "ok":
            # resolved natively within the tolerance: the float64 function was another one (where float64 autograd
            # disagrees with it too: a mixed-dtype kernel path, a float64-only branch; never the training's failure)
            task.result = native
            (right if task in formula_right else unreproduced).append(task.target)
        elif task in formula_right:
            # a native failure proves little on its own: float32 rounding of an ill-conditioned loss (logcumsumexp
            # near 1e4) misleads a native finite difference as much as the gradient
            rest.append((task, native))
    beyond = []
    for task, native in rest:
        first = task.result
        assert first is not None
        if right and native is not None and native.verdict != "fail":
            task.result = native  # float64 is another function in this check: the native measurement cannot tell
        elif _vector_error(task, first, portfolio) > multiple * plan.rtol_of(task):
            beyond.append(task.target)
            limit = max(limit, multiple * plan.rtol_of(task))
        else:
            task.mark("fail" if fail_on_imprecise else "ok", "imprecise")  # a right formula, imprecise natively
    dtype = str(native_dtype).removeprefix("torch.")
    if unreproduced:
        evaluator.notes.append(Note(NoteCode.FLOAT64_UNREPRODUCED, (
            f"measured in {dtype} along {', '.join(dict.fromkeys(unreproduced))}: the failure float64 finds there "
            f"does not reproduce in {dtype}, the precision training computes in (float64 evaluates another "
            "function)")))  # fmt: skip
    if right:
        evaluator.notes.append(Note(NoteCode.FLOAT64_UNFAITHFUL_THERE, (
            f"measured in {dtype} along {', '.join(dict.fromkeys(right))}: float64 evaluates another "
            f"function there (its slope differs from the {dtype} one)")))  # fmt: skip
    if beyond:
        evaluator.notes.append(Note(NoteCode.IMPRECISE_BEYOND_ROUNDING, (
            f"along {', '.join(dict.fromkeys(beyond))}, float64 autograd agrees with the float64 finite difference "
            f"but the {dtype} gradient is more than {limit:.1%} off: more than {dtype} rounding of a correct "
            f"formula explains (a backward wrong in {dtype} only?)")))  # fmt: skip


def _measured_natively(
    evaluator: LossEvaluator, portfolio: Portfolio, tasks: Sequence[ProbeTask], plan: ProbePlan
) -> list[Assessment | None]:
    """Each task measured again in the native precision, at native steps (``None`` for all when the native loss
    cannot be reproduced). Float64 cannot vouch for a gradient that a native measurement shows wrong for the native
    function: its float64 evaluation computes another function, or its backward is wrong only in the native dtype (a
    kernel specialised by dtype)."""
    if not tasks:
        return []
    reference, native_dtype = portfolio.reference, plan.native_dtype
    reproduced = reproduced_center(evaluator, reference, math.nan, native_dtype, native_dtype)
    if reproduced is None:
        return [None] * len(tasks)
    measuring = plan.ladder(Measurements(evaluator, *reproduced), reference.loss)
    replicas = []
    for task in tasks:
        native = relative_step(native_dtype, native_dtype, direction=task.index is None)
        replica = portfolio.replica(task, evaluator, reference)
        replica.step = replica.initial_step = task.initial_step * native / relative_step(torch.float64, native_dtype)
        replicas.append(replica)
    measuring.measure_fully(replicas)
    for task, replica in zip(tasks, replicas, strict=True):
        task.evaluations += replica.evaluations
    return [replica.result for replica in replicas]


def hooked_reference(reference: Reference, native_params: Sequence[tuple[str, Tensor]]) -> Reference:
    """The float64 gradient as training would get it: the hooks registered on each parameter (``register_hook``), which
    autograd runs on the parameter itself but not on its float64 copy, applied to its float64 gradient (a bug that
    lives in such a hook must not pass for rounding)."""
    grads: list[Tensor | None] = []
    for (_, param), grad in zip(native_params, reference.param_grads, strict=True):
        grads.append(with_parameter_hooks(param, grad) if grad is not None else None)  # a complex one's too
    return Reference(reference.loss, grads, reference.input_grads)


def _agrees(task: ProbeTask, precise: float) -> bool:
    """Whether float64 autograd (``precise``) agrees with the task's float64 numeric within float64's tolerance and the
    numeric's noise."""
    result = task.result
    assert result is not None
    allowed = max(relative_tolerance(torch.float64) * result.scale, SIGNIFICANCE * result.noise)
    return abs(precise - result.numeric) <= allowed
