"""One check of the gradient the optimizer applies: :func:`check_applied_gradient`.

1. **Consistency across ranks** (DDP): every rank must hold the same reduced gradient; per-tensor checksums are
   compared, and a rank that disagrees is named (fault ``"reduction"``). Ranks that hold other parameters (a model
   split by hand) are no replicas: the check is made of every rank's part together (:mod:`.split`).
2. **The noise floor of the path** (:mod:`.verdict`): per tensor, how far a correct gradient of the path's precision is
   from a more precise one, measured with trusted gradients (:mod:`.gradients`).
3. **The probes** (:mod:`.probes`): central differences of the window's loss (:mod:`.window`), on float64 storage
   where the model allows it, outside autocast, along the applied gradient and along each tensor's part of it.
4. **The attribution** of a failure (:mod:`.attribution`), and for a formula fault today's culprit search.

The model's parameters, buffers, ``.grad`` (the very tensors, bit for bit), random states and modes are left as they
were: the optimizer then steps with the same gradient.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from gradwatch.engine import validation as validate
from gradwatch.engine.applied.attribution import nonfinite_fault, recomputed_search
from gradwatch.engine.applied.autocast_path import path_autocast
from gradwatch.engine.applied.equivalence import Equivalence, Join, compare_accumulation
from gradwatch.engine.applied.measurement import AppliedOutcome, measure_window
from gradwatch.engine.applied.path import AppliedPlan, CheckedWindow
from gradwatch.engine.applied.split import (
    ShardedWindow,
    SplitModel,
    replicated_note,
    shard_window,
    split_note,
    split_window,
)
from gradwatch.engine.applied.verdict import floor_multiple, relative_floor
from gradwatch.engine.applied.window import (
    COMBINES,
    Checksums,
    Combine,
    PathContext,
    applied_gradients,
    disagreeing_ranks,
    ranks_with_other_parameters,
)
from gradwatch.engine.function.batch import batch_size
from gradwatch.engine.function.evaluation import LossFn
from gradwatch.engine.function.memory import affordable_samples, surviving_out_of_memory
from gradwatch.engine.numerics.steps import most_precise
from gradwatch.engine.probing.search_budget import SearchBudget
from gradwatch.engine.recomputed.compiled import compiled_parts
from gradwatch.engine.results.kinds import ProbeKind, Reason, Verdict
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import CheckReport, Probe
from gradwatch.engine.session import CheckSession
from gradwatch.engine.settings import ProbeOptions, ProbeSettings
from gradwatch.engine.unreached import unreached_note

__all__ = ["check_applied_gradient", "path_autocast"]


@validate.suggests_options(ProbeOptions)
def check_applied_gradient(
    model: nn.Module,
    batches: Sequence[Any],
    loss_fn: LossFn,
    gradients: Mapping[str, Tensor] | Sequence[Tensor] | None = None,
    *,
    combine: Combine = "mean",
    rng_states: Sequence[dict[str, Any] | None] | None = None,
    path: PathContext | None = None,
    step: int = 0,
    group: Any = None,
    start: Checksums | None = None,
    rotation: int = 0,
    closer_look: bool = True,
    culprit_search: bool = True,
    loss_scale: float = 1.0,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    settings: ProbeSettings | None = None,
    compare_one_batch: bool = True,
    join: Join | None = None,
    window_normalised: bool | Callable[[], bool] = False,
    search_budget: SearchBudget | None = None,
    float64_probes: bool = True,
    **options: Unpack[ProbeOptions],
) -> CheckReport:
    """Check the gradient the optimizer is about to apply against central differences of the window's loss.

    Stock surrogates (spectral norm's power iteration, padding rows, embeddings with ``scale_grad_by_freq``) are
    handled as :func:`~gradwatch.check_gradients` handles them. What the check does around its measurements (the
    parameters it selects, the state it puts back and names when it cannot) is the check session's
    (:class:`~gradwatch.engine.session.CheckSession`), as for the recomputed check.

    Args:
        model: The module whose trainable floating parameters the optimizer updates. A DeepSpeed engine: the module
            it wraps, with ``gradients`` DeepSpeed's full reduced gradients (``deepspeed.utils.safe_get_full_grad``;
            :func:`gradwatch.integrations.deepspeed.full_gradients`); under ZeRO-3 its parameters are gathered whole
            for the check, and ``group`` defaults to the one ZeRO averages over.
        batches: The micro-batches of the accumulation window, in order (one for a loop without accumulation).
        loss_fn: ``loss_fn(model, batch) -> scalar Tensor``, the loss of one micro-batch as the loop computes it.
        gradients: The gradients to check, by parameter name or in the order of the trainable parameters; by default
            each parameter's ``.grad`` (read, never changed; a parameter without one is not checked).
        combine: How the loop combines micro-batch losses: ``"mean"`` (Lightning; a loop dividing each loss by the
            number of micro-batches), ``"sum"``, or ``combine(losses) -> Tensor``.
        rng_states: The random state before each micro-batch's forward (``capture_rng()``), replayed so dropout draws
            the training's masks; ``None`` for a loss without randomness.
        path: A factory of the context the training's forward ran in, e.g. ``lambda: torch.autocast("cpu",
            dtype=torch.bfloat16)``; only recomputations of the path use it (finite differences never run in 16 bits).
        step: The optimizer step, recorded on the report.
        group: Under DDP, the process group: every rank calls the check together, the loss is the mean of the ranks'
            window losses, and the ranks' gradients are compared.
        start: The fingerprint of the gradients present when the window began (:class:`AppliedWindow` records it): a
            leftover of an earlier window is then recognised as an accumulation fault.
        rotation: Which window of tensors the probes cover (the check's position in a series).
        closer_look: ``False``: when the combined probes all agree, stop there and leave the float64 floor and the
            tensor probes to a later check, with a note ``applied-closer-look-deferred`` saying what was looked at
            (a watch's first applied check, which no budget bounds: :mod:`~gradwatch.engine.applied.probes`); a
            probe that does not agree goes on to them at once.
        culprit_search: For a formula fault, run :func:`~gradwatch.check_gradients` on the first micro-batch to name
            the module whose backward is wrong.
        optimizers: Optimizers whose state the check puts back if the loss changes it (a learning rate decayed inside
            the loss, say), as :func:`~gradwatch.check_gradients` does.
        loss_scale: The factor a float16 loop scales its loss by (``GradScaler.get_scale()``): recomputations of the
            path scale it alike, so that its float16 gradients do not underflow where training's did not.
        settings: The probe options as one :class:`~gradwatch.engine.settings.ProbeSettings` (what a series of checks
            passes, built once for a run); then none one by one.
        compare_one_batch: For a window of several micro-batches, compare the accumulated gradient with the gradient
            of its samples taken as one batch (:mod:`~gradwatch.engine.applied.equivalence`: two or three more backward
            passes): ``accumulation_scale`` and ``accumulation_cosine`` on the report, a warning note when they differ.
        join: ``join(items) -> item``: the window's micro-batch items as one item of all their samples, for that
            comparison (by default :func:`~gradwatch.engine.applied.equivalence.concatenate`; a loop whose items carry
            more than the batch, such as Lightning's batch index, joins them itself).
        window_normalised: Each micro-batch's loss is already divided by the whole window's count of samples or tokens
            (transformers' ``num_items_in_batch``): an accumulated gradient that is the one-batch one divided by the
            window's size is then warned of as a second normalisation, not taken for a summed loss averaged over the
            window. A function that says so is asked only when that comparison finds such a division.
        search_budget: A cap on the culprit search of a formula fault (the recomputed check of the first micro-batch
            and its search, both within it), and where an earlier search left off, as
            :func:`~gradwatch.check_gradients` takes it; ``None``: no cap.
        float64_probes: ``False``: probe natively (with float64 reductions) without trying float64 first, as a watch
            does for a while after float64 probes ran out of memory (:class:`~gradwatch.watch.lessons.Lessons`).
        **options: The probe options one by one, fields of :class:`~gradwatch.engine.settings.ProbeSettings` (documented
            there with their defaults): ``tensor_probes`` (tensors probed along their part of the gradient; all if
            descent fails), ``ignore``, ``seed`` (of the culprit search) and ``hold_detached``; the others concern the
            recomputed check alone and are not used.

    Returns:
        A :class:`~gradwatch.CheckReport` with ``scope="applied"``; ``fault`` names the part of the path at fault when
        the check fails, ``noise_floor`` and ``floor_excess`` say how the verdict was calibrated.
    """
    with CheckSession.open(model, loss_fn, step=step, settings=settings, options=options, optimizers=optimizers,
                           gradients=gradients, group=group, applied=True) as session:  # fmt: skip
        gradients, group = session.whole.gradients, session.whole.group
        setting = _window(session, batches, loss_fn, combine=combine, rng_states=rng_states, path=path, group=group,
                          start=start, loss_scale=loss_scale)  # fmt: skip
        setting.search_budget = search_budget
        names, applied, shards = _selected(setting, gradients)
        split = [] if setting.group is None else ranks_with_other_parameters(session.params, setting.group)
        if split and not isinstance(
            model, SplitModel
        ):  # not replicas, but made so for the check (a rank may hold none)
            return _split_check(setting, names, applied, split, (rotation, closer_look))
        if not names:  # every gradient left out (ignore=, none given): nothing to hold against the loss
            text = "no probe made: no trainable parameter with a gradient is left to check (ignore=, or no gradient)"
            return session.report(verdict=Verdict.INCONCLUSIVE, probes=[], loss=math.nan, scope="applied",
                                  notes=[Note(NoteCode.NOTHING_TO_PROBE, text)])  # fmt: skip
        plan = dataclasses.replace(_plan(setting, names, applied, rotation), closer_look=closer_look,
                                   float64=float64_probes)  # fmt: skip
        postponed = _postponed(setting)
        if postponed is not None:
            return postponed
        equivalence, said = None, list[Note]()
        with surviving_out_of_memory(None, setting.params[0].device) as ran_out:
            refused = _refused(setting, plan, shards, culprit_search=culprit_search)  # its finite test may run out too
            if refused is None:
                with session.measuring():
                    outcome = measure_window(setting, plan)
                    if compare_one_batch and len(setting.batches) > 1 and session.collective is None:
                        equivalence, said = compare_accumulation(setting, plan.names, join=join,
                                                                 window_normalised=window_normalised)  # fmt: skip
        if ran_out:  # the state is back and what the check allocated freed: the run goes on
            return session.report(
                verdict=Verdict.INCONCLUSIVE, probes=[], loss=math.nan, notes=ran_out, scope="applied"
            )
        if refused is not None:
            return refused
        outcome.evaluator.notes.extend(said)
        if outcome.attribution is not None and outcome.attribution.search_culprit and not isinstance(model, SplitModel):
            outcome = _searched(
                setting, outcome, culprit_search=culprit_search
            )  # a split model's: one rank's loss alone
        return _report(session, outcome, equivalence)


def _window(session: CheckSession, batches: Sequence[Any], loss_fn: LossFn, *, combine: Combine,
            rng_states: Sequence[dict[str, Any] | None] | None, path: PathContext | None, group: Any,
            start: Checksums | None, loss_scale: float) -> CheckedWindow:  # fmt: skip
    """The window's facts, validated."""
    micro_batches = list(batches) if isinstance(batches, (list, tuple)) else []
    if not micro_batches:
        raise ValueError("`batches` must be a non-empty list or tuple of the window's micro-batches")
    validate.check_choice("combine", combine, COMBINES, allow_callable=True)
    states = list(rng_states) if rng_states is not None else [None] * len(micro_batches)
    if len(states) != len(micro_batches):
        raise ValueError(f"`rng_states` must have one entry per micro-batch ({len(micro_batches)}); got {len(states)}")
    return CheckedWindow(session=session, batches=micro_batches, loss_fn=loss_fn, rng_states=states, combine=combine,
                       path=path, group=group, start=start, loss_scale=loss_scale)  # fmt: skip


def _selected(
    setting: CheckedWindow, gradients: Mapping[str, Tensor] | Sequence[Tensor] | None
) -> tuple[list[str], list[Tensor], ShardedWindow | None]:
    """The names of the parameters checked and their applied gradient (this rank's rows of it when sharded), with the
    leading notes on what is left out; under FSDP2 the sharded window, the DDP group then dropped."""
    session = setting.session
    trainable = [(n, p) for n, p in session.model.named_parameters()
                 if p.requires_grad and (p.is_floating_point() or p.is_complex())]  # fmt: skip
    given = applied_gradients(trainable, gradients)
    gradient = {name: g for (name, _), g in zip(trainable, given, strict=True) if g is not None}
    session.select(only=gradient)  # FSDP2: this rank's shards, every rank checking together
    names = [name for name, _ in session.params]
    applied = [gradient[name].detach() for name in names]
    applied = [torch.view_as_real(g.resolve_conj()) if g.is_complex() else g for g in applied]  # as a complex one's
    # real view is probed (:mod:`~gradwatch.engine.function.complex_params`)
    start = setting.start
    if start is not None and len(start.sums) == len(trainable):
        position = {name: i for i, (name, _) in enumerate(trainable)}
        setting.start = Checksums(tuple(start.sums[position[name]] for name in names))
    shards = None
    if session.collective is not None:
        shards = shard_window(session.collective, setting.params, applied)
        applied, setting.group = shards.applied, None
        session.leading.append(Note(NoteCode.SHARDED, shards.note()))
    session.leading += unreached_note(session.model, trainable, given, probed=False) if gradients is None else []
    unchecked = len(trainable) - len(names)
    if unchecked:
        text = f"{unchecked} trainable parameter(s) not checked (no gradient, ignore=, or not the derivative by design)"
        session.leading.append(Note(NoteCode.APPLIED_UNCHECKED, text))
    return names, applied, shards


def _plan(setting: CheckedWindow, names: list[str], applied: list[Tensor], rotation: int) -> AppliedPlan:
    """The plan of the probes, judged at the floor of the path's precision (its autocast dtype, else the parameters'
    most precise one)."""
    session = setting.session
    setting.autocast = path_autocast(setting.path)
    setting.compiled = bool(compiled_parts(session.model))
    native = most_precise(p.dtype for _, p in session.params)
    path_dtype = setting.autocast or native
    return AppliedPlan(names=names, applied=applied, native=native, path_dtype=path_dtype,
                       multiple=floor_multiple(path_dtype), tensor_probes=session.settings.tensor_probes,
                       rotation=rotation)  # fmt: skip


def _refused(
    setting: CheckedWindow, plan: AppliedPlan, shards: ShardedWindow | None, *, culprit_search: bool
) -> CheckReport | None:
    """The report of a window settled before any probe: ranks whose reduced gradients differ (``"reduction"``), a
    gradient with non-finite values; ``None`` for a window to probe."""
    session = setting.session
    if setting.group is not None:
        disagreeing = disagreeing_ranks(plan.applied, setting.group)
        if disagreeing:
            message = f"rank(s) {disagreeing} hold a different gradient than rank 0 after the reduction"
            probe = Probe(ProbeKind.DESCENT, "*", None, math.nan, math.nan, math.inf, verdict=Verdict.FAIL,
                          noise=math.nan, step=0.0, reason=Reason.DISCREPANCY)  # fmt: skip
            return session.report(verdict=Verdict.FAIL, probes=[probe], loss=math.nan, scope="applied",
                                  fault="reduction", fault_message=message)  # fmt: skip
    if shards.finite() if shards is not None else all(bool(torch.isfinite(g).all()) for g in plan.applied):
        return None
    probe = Probe(ProbeKind.LOSS, "*", None, math.inf, math.nan, math.inf, verdict=Verdict.FAIL, noise=math.nan,
                  step=0.0, reason=Reason.NONFINITE)  # fmt: skip
    named = list(zip(plan.names, plan.applied, strict=True))
    fields = nonfinite_fault(setting, named, search=culprit_search and shards is None)
    return session.report(verdict=Verdict.FAIL, probes=[probe], loss=math.nan, scope="applied", **fields)


def _postponed(setting: CheckedWindow) -> CheckReport | None:
    """The report of a check whose window would not fit in the device's free memory (a window cannot shrink); ``None``:
    it fits, or that is unknown, or ranks in lockstep would decide apart."""
    session = setting.session
    window = sum(batch_size(b) or 0 for b in setting.batches)
    if session.collective is not None or setting.group is not None or not window:
        return None
    samples, why = affordable_samples(session.model, setting.params, window, window)
    if samples:
        return None
    text = f"no probe made: the window would not fit in the device's free memory ({why}); the next check tries again"
    return session.report(verdict=Verdict.INCONCLUSIVE, probes=[], loss=math.nan, scope="applied",
                          notes=[Note(NoteCode.MEMORY_POSTPONED, text)])  # fmt: skip


def _split_check(
    setting: CheckedWindow, names: list[str], applied: list[Tensor], ranks: list[int], turn: tuple[int, bool]
) -> CheckReport:
    """The check of a model split across the ranks by hand, as replicas of every rank's part (:mod:`.split`), with no
    culprit search of one rank's loss (its collectives would wait for the others) and no one-batch comparison. A
    gradient wrong for the ranks' summed loss whose ranks all compute the same loss is checked again against that loss
    (Megatron's convention): the report kept is the one where fewer tensors fail."""
    session, group = setting.session, setting.group
    split = split_window(session.model, setting.loss_fn, names, applied, group)
    rotation, closer_look = turn

    def check(scale: float) -> CheckReport:
        return check_applied_gradient(
            split.model, setting.batches, split.loss(scale), split.gradients, combine=setting.combine,
            rng_states=setting.rng_states, path=setting.path, step=session.step, group=group, rotation=rotation,
            closer_look=closer_look, culprit_search=False, loss_scale=setting.loss_scale,
            optimizers=session.optimizers, settings=session.settings, compare_one_batch=False,
            search_budget=setting.search_budget,
        )  # fmt: skip

    report, said = check(split.world), split_note(ranks, split.world)
    if split.replicated(group) and report.verdict == Verdict.FAIL:
        again = check(1.0)  # the convention of most tensors' gradients: a fault in a few of them fails in its own
        if again.verdict != Verdict.FAIL or len(_failing(again)) < len(_failing(report)):
            report, said = again, f"{said}; {replicated_note(split.world)}"
    notes = [*session.leading, Note(NoteCode.RANKS_SPLIT, said), *report.notes, *session.closing()]
    return dataclasses.replace(report, notes=notes)


def _failing(report: CheckReport) -> set[str]:
    return {p.target for p in report.probes if p.verdict == Verdict.FAIL}


def _searched(setting: CheckedWindow, outcome: AppliedOutcome, *, culprit_search: bool) -> AppliedOutcome:
    """A formula fault's recomputed check of the first micro-batch: the module at fault, or the straight-through
    estimators (surrogates, recognised by their signature) that explain every failure, which is then none."""
    found = recomputed_search(setting, outcome.evaluator.notes)
    surrogate = {p.target for p in found.probes if p.reason == Reason.SURROGATE}
    failing_targets = {p.target for p in outcome.probes if p.verdict == "fail"}
    if failing_targets and failing_targets <= surrogate:  # each measured a gradient not the derivative by design
        probes = [dataclasses.replace(p, verdict=Verdict.INCONCLUSIVE, reason=Reason.SURROGATE)
                  if p.verdict == "fail" or p.target in surrogate else p for p in outcome.probes]  # fmt: skip
        return dataclasses.replace(outcome, probes=probes, surrogates=found.surrogates, attribution=None)
    if culprit_search:
        return dataclasses.replace(outcome, culprits=found.culprits, culprit_message=found.culprit_message,
                                   culprit_search=found.culprit_search)  # fmt: skip
    return outcome


def _report(session: CheckSession, outcome: AppliedOutcome, equivalence: Equivalence | None) -> CheckReport:
    """The applied check's report: the probes' verdict, the fault, how the verdict was calibrated and the one-batch
    comparison."""
    evaluator, attribution = outcome.evaluator, outcome.attribution
    descent = next((m for m in outcome.measured if m.probe.kind == ProbeKind.DESCENT), None)
    return session.report(
        **outcome.report_fields(),
        n_backward=outcome.backward + (equivalence.backward if equivalence is not None else 0),
        n_passes=evaluator.n_forward,
        precision=evaluator.probed_in,  # what the probes computed in (float64 reductions alone are native)
        scope="applied",
        fault=attribution.fault if attribution is not None else None,
        fault_message=attribution.message if attribution is not None else "",
        noise_floor=relative_floor(descent.probe if descent else None),
        floor_excess=max((m.excess for m in outcome.measured if math.isfinite(m.excess)), default=math.nan),
        accumulation_scale=equivalence.scale if equivalence is not None else math.nan,
        accumulation_cosine=equivalence.cosine if equivalence is not None else math.nan,
    )
