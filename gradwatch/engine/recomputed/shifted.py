"""Before a probe fails: is the point a tie (:mod:`.confirmation`)?

At a tie (max-pool windows over an exactly constant background, ReLU at exactly zero, ``grid_sample`` with every sample
on the grid) the loss has a left and a right derivative; autograd returns one of them (or, through compositions, a
value outside both), a central difference their mean, at any step. :func:`confirm_at_a_shifted_point` moves the point
a little (every parameter and input by :data:`SHIFT` of its own size, in a random direction), computes the gradient
there and measures each failing probe again along the same direction. A wrong backward is wrong at any point and fails
again; a tie does not survive the shift, and the probe ends ``inconclusive`` with reason ``"tie"``.

A backward can also be wrong exactly at a special point of a smooth loss (a logit at 0 under a zero-initialised head,
an exact zero factor of a product, a sample exactly on a border under an identity-initialised warp), and the shift moves
away from that point too. So a failure that the shifted point does not reproduce is called a tie only where the loss
has a kink at the point along the probe (:func:`~gradwatch.engine.numerics.kinks.smooth_at_the_point`: the one-sided
difference quotients keep their jump at two steps); at a smooth point the failure stands.

The failing probes are measured again a few at a time (:data:`CONFIRMED_AT_ONCE`), the most significant first, until
one stands: a wrong backward deep in a large model fails every tensor upstream of it, and one standing failure fails
the check (a note says how many were left unmeasured).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

import torch
from torch import Tensor

from gradwatch.engine.function.evaluation import LossEvaluator, Reference
from gradwatch.engine.function.precision import probe_precision
from gradwatch.engine.measuring.points import Measurements
from gradwatch.engine.numerics.assessment import Assessment
from gradwatch.engine.numerics.kinks import smooth_at_the_point
from gradwatch.engine.numerics.norms import rms
from gradwatch.engine.numerics.steps import machine_epsilon
from gradwatch.engine.probing.ladder import significance
from gradwatch.engine.probing.plan import ProbePlan
from gradwatch.engine.probing.portfolio import Portfolio
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.recomputed.reference import reproduced_center
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.errors import passes_fallbacks

SHIFT = 1e-2
"""How far the second point is from the first: each parameter and input moves by this fraction of its own RMS, in a
random direction. Far beyond the probes' steps (about 6e-6 of the same scale in float64), so that the stencils at the
second point cross none of the kinks the shift moved them away from; near enough that the gradient there is the same
code on almost the same values."""

MOVED_LOSS = 0.2
"""The most the shift may move the loss, relative to it: a point that far is no longer "a little shifted" (a float
label compared with ``==``, say, now matches nothing), and a failure is left standing on its confirmations at the
point rather than judged there."""

CONFIRMED_AT_ONCE = 4
"""How many failing probes are measured again at the shifted point at a time, the most significant first; once one of
them stands, the others are not measured (a note says how many)."""

VANISHED = 0.01
"""A probe whose analytic derivative at the shifted point is below this fraction of the first one's says nothing of
the first point's discrepancy: the failure stands."""


def confirm_at_a_shifted_point(
    evaluator: LossEvaluator, portfolio: Portfolio, tasks: Sequence[ProbeTask], plan: ProbePlan, mode: str
) -> None:
    """Measure every failing task of the check's ``plan`` again at a shifted point (see the module doc), in the
    precision ``mode`` they were measured in; a failure that does not reproduce becomes inconclusive (``"tie"`` where
    the probe agrees there, ``"unstable"`` where it cannot tell). The parameters and inputs of ``evaluator`` (native)
    are shifted in place and put back exactly, the shift drawn from the plan's seed and step (every process of a
    distributed run shifts alike)."""
    plan = dataclasses.replace(plan, vectorize=plan.vectorize and not evaluator.state.sandbox.unrestorable())
    # an "imprecise" failure (fail_on_imprecise) is rounding, which no other point reproduces: float64 has settled it
    failing = [task for task in tasks if task.failed and task.result is not None and task.result.reason != "imprecise"]
    # the most significant first, a few at a time: one failure that stands fails the check, and a wrong backward
    # upstream of many tensors fails them all (confirming each cost a diffusion UNet minutes per failing check)
    failing.sort(key=significance, reverse=True)
    for start in range(0, len(failing), CONFIRMED_AT_ONCE):
        batch = failing[start : start + CONFIRMED_AT_ONCE]
        if not _confirm_batch(evaluator, portfolio, batch, plan, mode):
            return
        rest = failing[start + len(batch) :]
        if any(task.failed for task in batch) and rest:
            evaluator.notes.append(Note(NoteCode.SHIFT_BUDGET, (
                f"{len(rest)} more failing probe(s) not measured again at a shifted point: the "
                f"{sum(task.failed for task in batch)} most significant failure(s) stood there")))  # fmt: skip
            return


def _confirm_batch(
    evaluator: LossEvaluator, portfolio: Portfolio, failing: Sequence[ProbeTask], plan: ProbePlan, mode: str
) -> bool:
    """Measure ``failing`` again at the shifted point and judge them; ``False`` when that point could not be measured
    (the failures stand, with a note)."""
    original_loss = portfolio.reference.loss
    params = [p for _, p in evaluator.params]
    saved = [p.detach().clone() for p in params]
    generator = torch.Generator().manual_seed(random.Random(f"gradwatch-shift:{plan.seed}").getrandbits(63))
    scale = rms(*params) or 1.0
    replicas: list[ProbeTask] | None = None
    problem = "its loss is not finite or not reproducible"
    try:
        with torch.no_grad():
            for tensor in params:
                tensor.add_(_shift(tensor, generator, scale))
            # inputs the loss refuses displaced stay where they are (a target in [0, 1])
            movable = {} if evaluator.inputs_refused else evaluator.inputs
            inputs = {path: tensor + _shift(tensor, generator, scale) for path, tensor in movable.items()}
        with evaluator.moved_inputs(inputs):
            reference = evaluator.reference(with_inputs=any(task.kind.traits.moves_inputs for task in failing))
            moved = abs(reference.loss - original_loss) / (abs(original_loss) or 1.0)
            if moved > MOVED_LOSS:
                problem = f"the shift moved the loss by {moved:.0%} (a discrete use of a floating input?)"
            elif math.isfinite(reference.loss):
                replicas = _measured_replicas(evaluator, portfolio, reference, failing, plan, mode)
    except Exception as error:
        if passes_fallbacks(error):
            raise
        problem = f"the loss raised {type(error).__name__} there ({error})"
    finally:
        with torch.no_grad():
            for tensor, value in zip(params, saved, strict=True):
                tensor.copy_(value)
    if replicas is None:
        # rare, and no sign of a tie: the failures stand on their confirmations at the point
        evaluator.notes.append(
            Note(NoteCode.SHIFT_UNMEASURED, f"the failures could not be measured again at a shifted point: {problem}")
        )
        return False
    for task, replica in zip(failing, replicas, strict=True):
        _judge_elsewhere(task, replica, rounding_drawn=plan.measured_floor)
    return True


def _shift(tensor: Tensor, generator: torch.Generator, scale: float) -> Tensor:
    """A random displacement of :data:`SHIFT` times the RMS of ``tensor`` (of ``scale`` for a tensor of zeros), in its
    dtype."""
    noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
    noise.mul_(SHIFT * (rms(tensor) or scale))
    return noise.to(device=tensor.device, dtype=tensor.dtype)


def _measured_replicas(
    evaluator: LossEvaluator,
    portfolio: Portfolio,
    reference: Reference,
    failing: Sequence[ProbeTask],
    plan: ProbePlan,
    mode: str,
) -> list[ProbeTask] | None:
    """Each failing task, measured again at the evaluator's (shifted) point, around its own centre; ``None`` when
    that point's loss cannot be reproduced."""
    native_dtype = max((p.dtype for _, p in evaluator.params), key=machine_epsilon)
    with probe_precision(evaluator.model, evaluator, mode) as (_, trial):
        compute_dtype = max((p.dtype for _, p in evaluator.params), key=machine_epsilon)
        reproduced = reproduced_center(evaluator, reference, trial, native_dtype, compute_dtype)
        if reproduced is None:
            return None
        measurements = Measurements(evaluator, *reproduced)
        if plan.vectorize:
            measurements.start_vectorizing()
        measuring = plan.ladder(measurements, reference.loss)
        replicas = [portfolio.replica(task, evaluator, reference) for task in failing]
        measuring.measure_fully(replicas)
    measuring.remeasure_in_float64(replicas)
    return replicas


def _judge_elsewhere(task: ProbeTask, replica: ProbeTask, rounding_drawn: bool = False) -> None:
    """Keep the task's failure if its replica at the shifted point fails the same way, reporting the smaller of the
    two discrepancies (a wrong backward at a tie is measured more truly away from it); else make it inconclusive.
    ``rounding_drawn``: a 16-bit gradient judged against its measured floor, whose rounding is drawn anew at each
    point (where 16 bits move a ReLU's or max-pool's kink, a correct float16 BatchNorm bias gradient was 1.3% off at one
    point, 0.05% at the next) while a wrong 16-bit kernel is wrong at both: a failure the shifted point does not
    reproduce is that draw, smooth point or not."""
    first, second = task.result, replica.result
    assert first is not None
    assert second is not None
    task.evaluations += replica.evaluations
    if second.verdict == "fail" and (second.discrepancy > 0) == (first.discrepancy > 0):
        if second.rel_error < first.rel_error:
            task.direction, task.step = replica.direction, replica.step
            task.stencil, task.result = replica.stencil, second
        return
    if abs(replica.direction.analytic) < VANISHED * abs(task.direction.analytic):
        return  # the derivative vanished at the shifted point: no evidence either way
    if second.verdict == "ok" and smooth_at_the_point(task.stencil) and not rounding_drawn:
        return  # no kink at the point that a tie would need: the backward is wrong at that very point
    reason = "tie" if second.verdict == "ok" else "unstable"
    task.result = Assessment(first.numeric, first.discrepancy, first.noise, first.scale, "inconclusive", reason)
