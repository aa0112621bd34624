"""The probes of a check, made, measured and confirmed: :func:`measured_probes`.

The portfolio (:mod:`.probing.portfolio`) says which probes a check makes, the ladder (:mod:`.probing.ladder`) measures
each up from a two-point screen, the measuring service (:mod:`.measuring.points`) evaluates the points they ask for.
A failure is confirmed before it stands (:mod:`.confirmation`), and float64 probes that turn out to measure another
function than the model's are measured again natively (:mod:`.faithfulness`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from gradwatch.engine.culprits.search import localize
from gradwatch.engine.distributed.collective import active as sharding_active
from gradwatch.engine.function.evaluation import LossEvaluator, Reference
from gradwatch.engine.function.precision import probe_precision
from gradwatch.engine.measuring.points import InputsRefusedError, Measurements
from gradwatch.engine.numerics.steps import least_precise
from gradwatch.engine.probing.ladder import LOCALIZED_AT_MOST, Ladder
from gradwatch.engine.probing.plan import ProbePlan
from gradwatch.engine.probing.portfolio import Portfolio
from gradwatch.engine.probing.search_budget import SearchBudget
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.recomputed.confirmation import confirm_precision
from gradwatch.engine.recomputed.faithfulness import UnfaithfulFloat64Error, quantised
from gradwatch.engine.recomputed.formula import confirm_formula
from gradwatch.engine.recomputed.reference import reproduced_center
from gradwatch.engine.recomputed.shifted import confirm_at_a_shifted_point
from gradwatch.engine.recomputed.signatures import stop_gradients, straight_through
from gradwatch.engine.recomputed.sixteen_bit_floor import SixteenBitFloor, wanted
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import Probe, SearchProgress
from gradwatch.engine.unreached import unreached_note


@dataclasses.dataclass(frozen=True)
class MeasuredProbes:
    """What :func:`measured_probes` found."""

    probes: list[Probe]
    precision: str  # what they were measured in
    vectorized: bool | None  # whether points were evaluated in vectorised passes (None: not tried)
    surrogates: tuple[str, ...]  # deliberate surrogate gradients recognised, in words, with an ignore= pattern each
    culprits: list[str]  # the module whose backward is wrong and the modules containing it, most specific first
    culprit_message: str
    _: dataclasses.KW_ONLY
    rtol: float  # what the probes were judged with (measured for a 16-bit model: .sixteen_bit_floor)
    culprit_search: SearchProgress | None = None


def measured_probes(
    evaluator: LossEvaluator, reference: Reference, grad_norms: Sequence[float], plan: ProbePlan
) -> MeasuredProbes:
    """The check's probes, measured in the precision the ``plan`` asks for (natively again, with a note, where float64
    is not the model's function), their failures confirmed, deliberate surrogate gradients recognised
    (:mod:`.signatures`)."""
    model = evaluator.model
    floor, fixed = None, plan
    if wanted(plan, evaluator.params):
        floor = SixteenBitFloor(evaluator, plan, grad_norms, reference.loss)
        floor.measure_spread(reference.param_grads)
    with probe_precision(model, evaluator, plan.precision, step_seconds=plan.step_seconds) as (precision, trial):
        if floor is not None and precision == "float64":
            plan = floor.plan_on_float64()
            evaluator.notes += floor.notes
        elif precision != plan.precision and evaluator.notes[-1].code == NoteCode.FLOAT64_TOO_SLOW:
            plan = dataclasses.replace(plan, float64_refinement=True)  # float64 only where it decides a verdict
        try:
            tasks, portfolio, measurements = _probe_with_inputs_if_accepted(
                evaluator, reference, grad_norms, trial, plan
            )
            unfaithful = None
            if precision == "float64" and measurements is not None:
                unfaithful = quantised(tasks, measurements, reference.loss)
        except UnfaithfulFloat64Error as error:
            unfaithful = str(error)
    if unfaithful is not None:
        evaluator.notes.append(Note(NoteCode.FLOAT64_UNFAITHFUL, (
            f"probes run in the native precision: float64 evaluates another function ({unfaithful})")))  # fmt: skip
        precision, plan = "native", fixed  # native 16-bit probes resolve no measured floor
        tasks, portfolio, measurements = _probe_with_inputs_if_accepted(
            evaluator, reference, grad_norms, math.nan, plan
        )
    vectorized = None if measurements is None else measurements.vectorized_outcome
    surrogates: list[str] = []
    culprits: list[str] = []
    message = ""
    progress = None
    if portfolio is not None:
        surrogates += straight_through(evaluator, portfolio, tasks, plan.rtol)
        if any(task.failed for task in tasks):  # float64 autograd must disagree too, and at a shifted point
            if precision == "float64":
                confirm_precision(evaluator, portfolio, tasks, plan)
            confirm_at_a_shifted_point(evaluator, portfolio, tasks, plan, precision)
        # a formula fault within the tolerance is searched for on the float64 copy it was confirmed on
        found = confirm_formula(evaluator, portfolio, tasks, plan, precision)
        surrogates += stop_gradients(evaluator, tasks)
        if found is None and sharding_active() is None:  # the search's probes are per rank: not a global function
            searched_in = _search_precision(evaluator, plan, precision)
            found = localize(model, evaluator, portfolio, tasks, plan.ladder, searched_in, budget=plan.search_budget)
        if found is not None:
            evaluator.notes += found.notes
            culprits, message, progress = found.culprits, found.message, found.progress
            tasks = [*tasks, *found.tasks]
    probes = [task.probe() for task in tasks]
    evaluator.notes += unreached_note(model, evaluator.params, reference.param_grads, probes)
    return MeasuredProbes(probes, precision, vectorized, tuple(surrogates), culprits, message, rtol=plan.rtol,
                          culprit_search=progress)  # fmt: skip


def _probe_with_inputs_if_accepted(
    evaluator: LossEvaluator, reference: Reference, grad_norms: Sequence[float], center: float, plan: ProbePlan
) -> tuple[list[ProbeTask], Portfolio | None, Measurements | None]:
    """:func:`_probe`, again without input probes (with a note) when the loss refuses displaced inputs (an input that is
    also a target in [0, 1], a mask): the refusal costs the input probes, never the check."""
    if not evaluator.inputs_refused:
        noted = len(evaluator.notes)
        try:
            return _probe(evaluator, reference, grad_norms, center, plan)
        except InputsRefusedError as refused:
            del evaluator.notes[noted:]  # the attempt's notes (a vectorised pass the refusal made fail) do not hold
            evaluator.inputs_refused = True
            evaluator.notes.append(Note(NoteCode.INPUTS_REFUSED, (
                f"input probes skipped: the loss refuses displaced inputs ({refused}), as it does for an input "
                "that is also its target (in [0, 1] for binary_cross_entropy), a probability or a mask; parameters "
                "are probed")))  # fmt: skip
    settings = dataclasses.replace(plan.portfolio, probes=dataclasses.replace(plan.portfolio.probes, input_probes=0))
    without = dataclasses.replace(reference, input_grads={})
    return _probe(evaluator, without, grad_norms, center, dataclasses.replace(plan, portfolio=settings))


def _probe(
    evaluator: LossEvaluator, reference: Reference, grad_norms: Sequence[float], center: float, plan: ProbePlan
) -> tuple[list[ProbeTask], Portfolio | None, Measurements | None]:
    """The check's probes (the portfolio's anchor and screens up the ladder, the tensors after a failure, the
    replacements of coordinates that crossed a kink), their portfolio and their measurements."""
    compute_dtype = least_precise([p.dtype for _, p in evaluator.params])
    reproduced = reproduced_center(evaluator, reference, center, plan.native_dtype, compute_dtype)
    if reproduced is None:
        return [], None, None
    measurements = Measurements(evaluator, *reproduced)
    portfolio = Portfolio(evaluator, reference, grad_norms, plan.portfolio, plan.native_dtype, rtol=plan.rtol)
    ladder = plan.ladder(measurements, reference.loss)
    anchor = portfolio.anchor()
    if anchor is None:
        evaluator.notes.append(Note(NoteCode.NOTHING_TO_PROBE, (
            "no probe made: the model has no parameter to check and no input with a gradient")))  # fmt: skip
        return [], None, None
    screens = portfolio.screens(input_direction=not anchor.kind.traits.moves_inputs)
    unrestorable = evaluator.state.sandbox.unrestorable()
    if plan.vectorize and unrestorable:
        # what the loss changed in place and cannot be put back would keep the batched tensors of a vectorised pass
        evaluator.notes.append(Note(NoteCode.IN_PLACE_UNVECTORISED, (
            f"points evaluated one by one: the loss changes {unrestorable[0]} in place")))  # fmt: skip
    elif plan.vectorize:
        measurements.start_vectorizing()
    ladder.first_round(anchor, screens)
    done = [anchor, *screens]
    ladder.remeasure_in_float64(done)
    if any(task.failed for task in done):
        extra = _swept(evaluator, ladder, portfolio, portfolio.localization(done), plan.search_budget)
        left = ladder.escalate(extra, most=LOCALIZED_AT_MOST)
        if left:
            evaluator.notes.append(Note(NoteCode.LOCALIZATION_BUDGET, (
                f"{len(left)} more tensor(s) ({_first_targets(left)}) looked wrong on a screen but were not measured "
                f"further: only the {LOCALIZED_AT_MOST} most significant were")))  # fmt: skip
        if plan.search_budget is None or not plan.search_budget.exhausted():
            ladder.remeasure_in_float64(extra)
        done += extra
    replacements = portfolio.replacements(done)
    ladder.screen_and_escalate(replacements)
    done += replacements
    return done, portfolio, measurements


SWEPT_AT_ONCE = 16
"""The tensor probes a failing check screens between two looks at its cap (their points are evaluated together)."""


def _swept(
    evaluator: LossEvaluator, ladder: Ladder, portfolio: Portfolio, tasks: list[ProbeTask], budget: SearchBudget | None
) -> list[ProbeTask]:
    """The tensor probes of a failing check's sweep (a probe along each tensor not probed yet, so that the report names
    the tensors that are wrong), screened while the check's cap lasts: the sweep is the first thing a failing check
    spends beyond a healthy one, and on a model of hundreds of tensors it cost more than the culprit search, uncapped
    (two loss evaluations a tensor). The tensors with the largest gradients go first (a wrong gradient moves the
    descent probe that failed in proportion to them); those not reached are named in a note. Returns the tasks
    screened."""
    if budget is not None:
        budget.start()  # the cap covers the sweep, then the culprit search
    if budget is None or math.isinf(budget.seconds):  # no cap: every tensor, their points in one go
        ladder.screen(tasks)
        return tasks
    tasks = sorted(tasks, key=lambda task: -portfolio.tensor_grad_norms[task.tensor])
    swept = 0
    while swept < len(tasks) and (swept == 0 or not budget.exhausted()):
        ladder.screen(tasks[swept : swept + SWEPT_AT_ONCE])
        swept = min(swept + SWEPT_AT_ONCE, len(tasks))
    if swept < len(tasks):
        rest = tasks[swept:]
        evaluator.notes.append(Note(NoteCode.SWEEP_CAPPED, (
            f"{len(rest)} of the {len(tasks)} tensors not probed yet were not screened after the failure "
            f"({_first_targets(rest)}): "
            "the failing check's cap (max_culprit_search_steps) ran out; those with the largest gradients went "
            "first")))  # fmt: skip
    return tasks[:swept]


def _first_targets(tasks: Sequence[ProbeTask]) -> str:
    """The first three tasks' targets, for a note about them all."""
    return ", ".join(task.target for task in tasks[:3]) + (", ..." if len(tasks) > 3 else "")


def _search_precision(evaluator: LossEvaluator, plan: ProbePlan, precision: str) -> str:
    """The precision of a failing check's culprit search: float64 where the check's probes ran natively only because
    the model is above the float64 limit (``precision="auto"``, undecided probes measured again in float64) and the
    float64 re-measurement reproduced the loss. Native activation probes of a float32 model carry round-off near the
    tolerance (a diffusers UNet's attention: every probe of the search undecided, no culprit named); the float64 copy
    the search evaluates on is the one the re-measurement already made, for the failing check only."""
    refused = any(note.code == NoteCode.NO_FLOAT64_REMEASUREMENT for note in evaluator.notes)
    if precision == "native" and plan.precision == "native" and plan.float64_refinement and not refused:
        return "float64"
    return precision
