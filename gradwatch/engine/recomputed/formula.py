"""Within the tolerance: a wrong formula that float32's rounding allowance would hide.

A float32 gradient is judged against ``rtol`` (5e-4), above what float32 rounding of a correct gradient reaches on
hard cases (a memorised sample's cross-entropy). A wrong backward whose effect on the probed gradient is smaller (a
normalisation layer's backward missing a term, seen through a residual branch: 1.2e-5 on a Llama embedding) then
passes, even where float64 probes measure the discrepancy thousands of times above their noise. Float64 tells the two
apart: rounding is float32's, a wrong formula is wrong in float64 too.

:func:`confirm_formula` takes, in a check whose float64 probes all passed, the probes whose discrepancy is significant
(:data:`~gradwatch.engine.numerics.assessment.SIGNIFICANCE` times their noise) and above :data:`FORMULA_SUSPICION`,
and computes the gradient along them in float64 (one float64 forward and backward for all). Where float64 autograd
agrees with the float64 finite difference, the float32 gradient is only rounded: the probe stays ``ok``. Where it
disagrees by about what the float32 gradient does (the same formula's error, not another float64 function), the probe
is measured as a float64 model's would be, on the float64 copy, against float64 autograd, with
:data:`FORMULA_SUSPICION` as its tolerance: a full stencil, a confirming one, a shifted point where the loss has a
kink (:mod:`.shifted`). A failure that stands fails the probe; as after any failure, the tensors not probed yet are
screened (along their float64 gradients), and the culprit search runs on the float64 copy, where the bug's diluted
effect on module gradients stands far above float64's rounding; the tensor probes failing there are reported with the
search's probes.

Healthy checks pay one float64 forward and backward where a probe crosses the threshold (float32 rounding of a large
summed loss often does), and nothing more.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from gradwatch.engine.culprits.search import localize
from gradwatch.engine.culprits.words import Localization
from gradwatch.engine.function.complex_params import autograd_tensor
from gradwatch.engine.function.evaluation import LossEvaluator, Reference
from gradwatch.engine.function.precision import float64_storage, substitute_of
from gradwatch.engine.measuring.points import Measurements
from gradwatch.engine.numerics.assessment import AGREEMENT, SIGNIFICANCE
from gradwatch.engine.numerics.norms import norms
from gradwatch.engine.probing.ladder import LOCALIZED_AT_MOST, Ladder
from gradwatch.engine.probing.plan import ProbePlan
from gradwatch.engine.probing.portfolio import Portfolio
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.recomputed.reference import reproduced_center
from gradwatch.engine.recomputed.shifted import confirm_at_a_shifted_point
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.errors import passes_fallbacks

FORMULA_SUSPICION = 1e-6
"""The relative discrepancy above which a passing float32 probe measured in float64 has its formula checked in
float64, and the tolerance of that check: about 8 float32 epsilons, above the float32 rounding a float64 evaluation can
still carry (a backward that builds a float32 tensor of its own), below the 1.2e-5 of a Llama RMSNorm backward missing
its ``d(1/rms)/dx`` term, seen on the embedding through the residual stream."""


def confirm_formula(
    evaluator: LossEvaluator, portfolio: Portfolio, tasks: Sequence[ProbeTask], plan: ProbePlan, precision: str
) -> Localization | None:
    """Check in float64 the formula behind the passing probes of a float32 model measured in float64 whose
    discrepancy is significant but within the tolerance (see the module doc). A confirmed fault fails its probes (with
    a note) and is searched for on the float64 copy: returns that search, or ``None`` when no probe failed. Runs only
    where no probe failed already (their culprit search names the bug). ``evaluator`` must be on the native parameters
    and inputs; it is again afterwards."""
    if not plan.check_formula or precision != "float64" or plan.native_dtype != torch.float32:
        return None
    if any(task.failed for task in tasks):
        return None
    suspects = [task for task in tasks if _suspect(task)]
    if not suspects:
        return None
    try:
        return _confirmed(evaluator, portfolio, tasks, suspects, plan)
    except Exception as error:  # the probes' verdicts stand as measured
        if passes_fallbacks(error):
            raise
        evaluator.notes.append(Note(NoteCode.FORMULA_UNCHECKED, (
            f"no float64 check of the formula along {', '.join(dict.fromkeys(t.target for t in suspects))}: the "
            f"loss raised {type(error).__name__} ({error})")))  # fmt: skip
        return None


def _confirmed(
    evaluator: LossEvaluator,
    portfolio: Portfolio,
    tasks: Sequence[ProbeTask],
    suspects: Sequence[ProbeTask],
    plan: ProbePlan,
) -> Localization | None:  # confirm_formula once it has suspects
    with _on_float64(evaluator, any(task.kind.traits.moves_inputs for task in suspects)) as reference:
        replicas = [portfolio.replica(task, evaluator, reference) for task in suspects]
        pairs = zip(suspects, replicas, strict=True)
        wrong = [(task, replica) for task, replica in pairs if _formula_off(task, replica)]
        if not wrong:
            return None
        precise = dataclasses.replace(plan, rtol=FORMULA_SUSPICION, native_dtype=torch.float64, precision="native",
                                      float64_refinement=False, measure_floor=False, measured_floor=False,
                                      check_formula=False)  # fmt: skip
        grads = [
            g if g is not None else p.new_zeros(())
            for (_, p), g in zip(evaluator.params, reference.param_grads, strict=True)
        ]
        on_copy = Portfolio(
            evaluator, reference, norms(grads, exact=True), plan.portfolio, torch.float64, rtol=FORMULA_SUSPICION
        )
        reproduced = reproduced_center(evaluator, reference, math.nan, torch.float64, torch.float64)
        if reproduced is None:
            return None
        measurements = Measurements(evaluator, *reproduced)
        if plan.vectorize and not evaluator.state.sandbox.unrestorable():
            measurements.start_vectorizing()
        measuring = precise.ladder(measurements, reference.loss)
        measured = [replica for _, replica in wrong]
        measuring.measure_fully(measured)
        extra = _localization(measuring, on_copy, tasks, measured)
        confirm_at_a_shifted_point(evaluator, on_copy, measured + extra, precise, "native")
        evaluator.use_float64_inputs()  # the shift put the batch's own inputs back
        confirmed = [(task, replica) for task, replica in wrong if replica.failed]
        for task, replica in wrong:
            task.evaluations += replica.evaluations
        if not confirmed:
            return None
        for task, _ in confirmed:
            task.mark("fail", "discrepancy")
        note = _note(confirmed)
        evaluator.notes.append(note)
        located = [task for task in extra if task.failed]
        failing = [replica for _, replica in confirmed] + located
        found = localize(evaluator.model, evaluator, on_copy, failing, precise.ladder, "native")
        if found is not None:
            found.tasks[:0] = located  # reported with the search's probes: measured on the float64 copy too
        return found


def _localization(
    measuring: Ladder, on_copy: Portfolio, tasks: Sequence[ProbeTask], measured: Sequence[ProbeTask]
) -> list[ProbeTask]:
    """Once a probe failed on the float64 copy: every tensor the check did not probe along its gradient, screened there
    (at most :data:`LOCALIZED_AT_MOST` measured further), so that the culprit search knows which parameters' gradients
    are wrong, as after any failure (a gradient hook's bug shows in no module's input gradient)."""
    results = [task.result for task in measured if task.failed and task.result is not None]
    if not results:
        return []
    measuring.loss_noise = max(result.loss_noise for result in results)
    extra = on_copy.localization(tasks)
    measuring.screen_and_escalate(extra, most=LOCALIZED_AT_MOST)
    return extra


def _suspect(task: ProbeTask) -> bool:
    """Whether a passing probe's discrepancy is significant and above :data:`FORMULA_SUSPICION`."""
    result = task.result
    return (
        result is not None
        and result.verdict == "ok"
        and result.reason == "agrees"
        and not task.missing
        and result.rel_error > FORMULA_SUSPICION
        and abs(result.discrepancy) > SIGNIFICANCE * result.noise
    )


def _formula_off(task: ProbeTask, replica: ProbeTask) -> bool:
    """Whether float64 autograd along the task (the replica's analytic derivative) disagrees with the float64 numeric
    beyond :data:`FORMULA_SUSPICION` and the noise, by nearly what the native gradient does: the native gradient's error
    is then the formula's, not its rounding (float64 evaluating another function would err by something else)."""
    result = task.result
    assert result is not None
    precise = replica.direction.analytic
    off = result.numeric - precise
    if abs(off) <= max(FORMULA_SUSPICION * result.scale, SIGNIFICANCE * result.noise):
        return False
    return abs(off - result.discrepancy) <= AGREEMENT * max(abs(off), abs(result.discrepancy))


@contextmanager
def _on_float64(evaluator: LossEvaluator, with_inputs: bool) -> Iterator[Reference]:
    """The evaluator on float64 copies of the parameters (leaves of their own, so that the parameters' accumulators
    never see them) and float64 inputs, with the float64 gradient there. The hooks registered on each parameter
    (``register_hook``) are registered on its copy too, so that every float64 gradient taken there (at the point, at a
    shifted point, in the culprit search) is the one training would get: a bug that lives in a hook is found."""
    native_params = evaluator.params
    with float64_storage(evaluator.model) as substitutes:
        for _, p in native_params:
            original = autograd_tensor(p)
            leaf = substitutes.get(id(original))
            if leaf is not None:  # a float64 parameter is its own copy: its hooks run as they are
                leaf.requires_grad_()
                for hook in list((getattr(original, "_backward_hooks", None) or {}).values()):
                    leaf.register_hook(hook)
        evaluator.params = [(name, substitute_of(p, substitutes)) for name, p in native_params]
        evaluator.use_float64_inputs()
        try:
            yield evaluator.reference(with_inputs=with_inputs)
        finally:
            evaluator.params = native_params
            evaluator.use_native_inputs()


def _note(confirmed: Sequence[tuple[ProbeTask, ProbeTask]]) -> Note:
    worst = max(task.result.rel_error for task, _ in confirmed if task.result is not None)
    targets = ", ".join(dict.fromkeys(task.target for task, _ in confirmed))
    return Note(
        NoteCode.FORMULA_WRONG_BELOW_TOLERANCE,
        f"along {targets}: the gradient is off by {worst:.2g} (within the tolerance) and float64 autograd is off the "
        "float64 finite difference by as much, confirmed at a second step: the backward's formula is wrong, not its "
        "rounding",
    )
