"""One check of the gradient the optimizer applies: :func:`check_applied_gradient`.

1. **Consistency across ranks** (DDP): every rank must hold the same reduced gradient; per-tensor checksums are
   compared, and a rank that disagrees is named (fault ``"reduction"``).
2. **The noise floor of the path** (:mod:`.verdict`): per tensor, how far a correct gradient of the path's precision is
   from a more precise one, measured with trusted gradients (:mod:`.gradients`, :mod:`.rounding`).
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
import torch.distributed as dist
from torch import Tensor, nn
from typing_extensions import Unpack

from gradwatch.engine import validation as validate
from gradwatch.engine.applied import autocast_path, lazy_floor
from gradwatch.engine.applied import gradients as recompute
from gradwatch.engine.applied.attribution import Attribution, PathSetting, attribute
from gradwatch.engine.applied.autocast_path import path_autocast
from gradwatch.engine.applied.culprit_search import nonfinite_fault, recomputed_search
from gradwatch.engine.applied.equivalence import Join, compare_accumulation
from gradwatch.engine.applied.probes import AppliedPlan, Measured, measure, unresolved_note
from gradwatch.engine.applied.reduced_float32 import tf32_floors
from gradwatch.engine.applied.sharded import shard_window
from gradwatch.engine.applied.verdict import SPREAD_SCALE, distances, floor_multiple, floors, relative_floor
from gradwatch.engine.applied.window import (
    COMBINES,
    Checksums,
    Combine,
    PathContext,
    applied_gradients,
    disagreeing_ranks,
    ranks_with_other_parameters,
    split_note,
    unrecorded_randomness,
)
from gradwatch.engine.distributed.collective import active as sharding_active
from gradwatch.engine.distributed.whole import on_whole_parameters
from gradwatch.engine.function.evaluation import LossEvaluator, LossFn
from gradwatch.engine.function.memory import surviving_out_of_memory
from gradwatch.engine.numerics.norms import norms
from gradwatch.engine.numerics.steps import center_tolerance
from gradwatch.engine.recomputed.compiled import compiled_parts
from gradwatch.engine.results.kinds import ProbeKind, Reason, Verdict
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import CheckReport, Probe
from gradwatch.engine.session import CheckSession
from gradwatch.engine.settings import ProbeOptions, ProbeSettings
from gradwatch.engine.unreached import unreached_note

__all__ = ["check_applied_gradient", "path_autocast"]


def _rank_mean(value: float, group: Any) -> float:
    """The mean of ``value`` over the ranks of ``group`` (``value`` without one)."""
    if group is None:
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, group=group)
    return float(tensor.item()) / dist.get_world_size(group)


class _GlobalEvaluator(LossEvaluator):
    """The evaluator of the window loss, averaged over the ranks of ``group`` (the loss DDP's mean differentiates)."""

    group: Any = None

    def loss(self) -> float:
        return _rank_mean(super().loss(), self.group)


@validate.suggests_options(ProbeOptions)
@on_whole_parameters
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
    culprit_search: bool = True,
    loss_scale: float = 1.0,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    settings: ProbeSettings | None = None,
    compare_one_batch: bool = True,
    join: Join | None = None,
    window_normalised: bool | Callable[[], bool] = False,
    **options: Unpack[ProbeOptions],
) -> CheckReport:
    """Check the gradient the optimizer is about to apply against central differences of the window's loss.

    The probe options an applied check uses are ``tensor_probes`` (tensors probed along their part of the gradient; all
    if descent fails), ``ignore``, ``seed`` (of its culprit search) and ``hold_detached``: the fields of
    :class:`~gradwatch.engine.settings.ProbeSettings`, where they are documented with their defaults. Stock
    surrogates (spectral norm's power iteration, padding rows, embeddings with ``scale_grad_by_freq``) are handled as
    :func:`~gradwatch.check_gradients` handles them, besides the tensors ``ignore`` leaves out. What the check does
    around its measurements (the parameters it selects, the state it puts back and names when it cannot) is the check
    session's (:class:`~gradwatch.engine.session.CheckSession`), the same as the recomputed check's.

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
        culprit_search: For a formula fault, run :func:`~gradwatch.check_gradients` on the first micro-batch to name
            the module whose backward is wrong.
        optimizers: Optimizers whose state the check puts back if the loss changes it (a learning rate decayed inside
            the loss, say), as :func:`~gradwatch.check_gradients` does.
        loss_scale: The factor a float16 loop scales its loss by (``GradScaler.get_scale()``): recomputations of the
            path scale it alike, so that its float16 gradients do not underflow where training's did not.
        settings: The probe options as one :class:`~gradwatch.engine.settings.ProbeSettings` (what a series of checks
            passes, built once for a run); those options must then be left at their defaults. Its fields that concern
            the recomputed check alone (``random_probes``, ``precision``, ...) are not used.
        compare_one_batch: For a window of several micro-batches, compare the accumulated gradient with the gradient
            of its samples taken as one batch (:mod:`~gradwatch.engine.applied.equivalence`: two or three more backward
            passes): ``accumulation_scale`` and ``accumulation_cosine`` on the report, a warning note when they differ.
        join: ``join(items) -> item``: the window's micro-batch items as one item of all their samples, for that
            comparison (by default :func:`~gradwatch.engine.applied.equivalence.concatenate`; a loop whose items carry
            more than the batch, such as Lightning's batch index, joins them itself).
        window_normalised: Each micro-batch's loss is already divided by the whole window's count of samples or tokens
            (transformers' ``num_items_in_batch``), so their gradients must add up to the one-batch gradient: an
            accumulated gradient that is the one-batch one divided by the window's size is then warned of as a second
            normalisation, not taken for a summed loss averaged over the window. A function that says so is asked
            only when that comparison finds such a division.
        **options: The probe options one by one (``tensor_probes``, ``ignore``, ``seed``, ``hold_detached``): the
            fields of :class:`~gradwatch.engine.settings.ProbeSettings`; the others concern the recomputed check alone
            and are not used.

    Returns:
        A :class:`~gradwatch.CheckReport` with ``scope="applied"``; ``fault`` names the part of the path at fault when
        the check fails, ``noise_floor`` and ``floor_excess`` say how the verdict was calibrated.
    """
    session = CheckSession.open(model, loss_fn, step=step, settings=settings, options=options, optimizers=optimizers)
    micro_batches = list(batches) if isinstance(batches, (list, tuple)) else []
    if not micro_batches:
        raise ValueError("`batches` must be a non-empty list or tuple of the window's micro-batches")
    validate.check_choice("combine", combine, COMBINES, allow_callable=True)
    states = list(rng_states) if rng_states is not None else [None] * len(micro_batches)
    if len(states) != len(micro_batches):
        raise ValueError(f"`rng_states` must have one entry per micro-batch ({len(micro_batches)}); got {len(states)}")
    trainable = [
        (n, p) for n, p in model.named_parameters() if p.requires_grad and (p.is_floating_point() or p.is_complex())
    ]
    given = applied_gradients(trainable, gradients)
    gradient = {name: g for (name, _), g in zip(trainable, given, strict=True) if g is not None}
    session.select(only=gradient)  # FSDP2: this rank's shards, every rank checking together
    names = [name for name, _ in session.params]
    applied = [gradient[name].detach() for name in names]
    applied = [torch.view_as_real(g.resolve_conj()) if g.is_complex() else g for g in applied]  # as a complex one's
    # real view is probed (:mod:`~gradwatch.engine.function.complex_params`)
    if start is not None and len(start.sums) == len(trainable):
        position = {name: i for i, (name, _) in enumerate(trainable)}
        start = Checksums(tuple(start.sums[position[name]] for name in names))
    shards = None
    if session.collective is not None:
        shards = shard_window(session.collective, [p for _, p in session.params], applied)
        applied, group = shards.applied, None
        session.leading.append(Note(NoteCode.SHARDED, shards.note()))
    session.leading += unreached_note(model, trainable, given, probed=False) if gradients is None else []  # .grad
    unchecked = len(trainable) - len(names)
    if unchecked:
        text = f"{unchecked} trainable parameter(s) not checked (no gradient, ignore=, or not the derivative by design)"
        session.leading.append(Note(NoteCode.APPLIED_UNCHECKED, text))
    if not names:  # every gradient left out (ignore=, none given): nothing to hold against the loss
        text = "no probe made: no trainable parameter with a gradient is left to check (ignore=, or no gradient)"
        return session.report(verdict=Verdict.INCONCLUSIVE, probes=[], loss=math.nan, scope="applied",
                              notes=[Note(NoteCode.NOTHING_TO_PROBE, text)])  # fmt: skip
    autocast = path_autocast(path)
    native = min((p.dtype for _, p in session.params), key=lambda d: torch.finfo(d).eps, default=torch.float32)
    path_dtype = autocast or native
    plan = AppliedPlan(names, applied, native, path_dtype, floor_multiple(path_dtype), session.settings.tensor_probes,
                       rotation)  # fmt: skip
    if group is not None:
        split = ranks_with_other_parameters(session.params, group)
        if split:  # not replicas: their gradients differ by design, and no reduction is at fault
            return session.report(verdict=Verdict.INCONCLUSIVE, probes=[], loss=math.nan, scope="applied",
                                  notes=[Note(NoteCode.RANKS_SPLIT, split_note(split))])  # fmt: skip
        disagreeing = disagreeing_ranks(applied, group)
        if disagreeing:
            message = f"rank(s) {disagreeing} hold a different gradient than rank 0 after the reduction"
            probe = Probe(ProbeKind.DESCENT, "*", None, math.nan, math.nan, math.inf, Verdict.FAIL, math.nan, 0.0,
                          Reason.DISCREPANCY)  # fmt: skip
            return session.report(verdict=Verdict.FAIL, probes=[probe], loss=math.nan, scope="applied",
                                  fault="reduction", fault_message=message)  # fmt: skip
    if not (shards.finite() if shards is not None else all(bool(torch.isfinite(g).all()) for g in applied)):
        probe = Probe(ProbeKind.LOSS, "*", None, math.inf, math.nan, math.inf, Verdict.FAIL, math.nan, 0.0,
                      Reason.NONFINITE)  # fmt: skip
        named = list(zip(names, applied, strict=True))
        fields = nonfinite_fault(session, model, named, micro_batches[0], loss_fn, states[0], step,
                                 culprit_search and shards is None)  # fmt: skip
        return session.report(verdict=Verdict.FAIL, probes=[probe], loss=math.nan, scope="applied", **fields)
    setting = PathSetting(session, micro_batches, loss_fn, states, combine, path, autocast, bool(compiled_parts(model)),
                          group, start, loss_scale)  # fmt: skip
    equivalence, said = None, list[Note]()
    with surviving_out_of_memory(None, setting.params[0].device) as ran_out, session.measuring() as state:
        outcome = _measure(setting, plan)
        if compare_one_batch and len(micro_batches) > 1 and session.collective is None:
            equivalence, said = compare_accumulation(model, micro_batches, loss_fn, states, combine, setting.params,
                                                     names, state, group, join, window_normalised)  # fmt: skip
    if ran_out:  # the state is back and what the check allocated freed: the run goes on
        return session.report(verdict=Verdict.INCONCLUSIVE, probes=[], loss=math.nan, notes=ran_out, scope="applied")
    notes, attribution = outcome.evaluator.notes, outcome.attribution
    notes.extend(said)
    culprits: list[str] = []
    culprit_message = ""
    surrogates_found: tuple[str, ...] = ()
    probes = [m.probe for m in outcome.measured]
    if attribution is not None and attribution.search_culprit:
        # today's check recognises straight-through estimators by their signature: tensors it calls surrogates are
        # not faults of the formula, and a check whose failures they explain is not a failure
        found = recomputed_search(session, model, micro_batches[0], loss_fn, states[0], step, notes)
        surrogate = {p.target for p in found.probes if p.reason == Reason.SURROGATE}
        failing_targets = {p.target for p in probes if p.verdict == "fail"}
        if failing_targets and failing_targets <= surrogate:
            probes = [_undecided(p) if p.verdict == "fail" or p.target in surrogate else p for p in probes]
            surrogates_found, attribution = found.surrogates, None
        elif culprit_search:
            culprits, culprit_message = found.culprits, found.culprit_message
    descent = next((m for m in outcome.measured if m.probe.kind == ProbeKind.DESCENT), None)
    failing = any(p.verdict == "fail" for p in probes)
    evaluator = outcome.evaluator
    return session.report(
        verdict=Verdict.FAIL
        if failing
        else (Verdict.OK if any(p.verdict == "ok" for p in probes) else Verdict.INCONCLUSIVE),
        probes=probes,
        loss=outcome.loss,
        notes=notes,
        n_forward=evaluator.n_forward,
        n_backward=outcome.backward + (equivalence.backward if equivalence is not None else 0),
        n_passes=evaluator.n_forward,
        precision="float64" if evaluator.value_dtype == torch.float64 else "native",
        culprits=culprits,
        culprit_message=culprit_message,
        surrogates=surrogates_found,
        scope="applied",
        fault=attribution.fault if attribution is not None else None,
        fault_message=attribution.message if attribution is not None else "",
        noise_floor=relative_floor(descent.probe if descent else None),
        floor_excess=max((m.excess for m in outcome.measured if math.isfinite(m.excess)), default=math.nan),
        accumulation_scale=equivalence.scale if equivalence is not None else math.nan,
        accumulation_cosine=equivalence.cosine if equivalence is not None else math.nan,
    )


def _undecided(probe: Probe) -> Probe:
    """A failing probe explained by a straight-through estimator: it measured a gradient that is not the derivative by
    design (``ignore=`` it to leave it out)."""
    return dataclasses.replace(probe, verdict=Verdict.INCONCLUSIVE, reason=Reason.SURROGATE)


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """What the measuring part of an applied check produced."""

    evaluator: LossEvaluator
    measured: list[Measured]
    attribution: Attribution | None
    loss: float
    backward: int
    floors: list[float]


def _measure(setting: PathSetting, plan: AppliedPlan) -> _Outcome:
    """The applied check's measurement plan, inside its session: the window's loss and eager gradient, the path's
    noise floor, the probes, and for a failure the attribution to a part of the path."""
    model, params, state, group = setting.model, setting.params, setting.state, setting.group
    window = setting.window(with_path=False)
    session = setting.session
    evaluator = _GlobalEvaluator(model, setting.batches, window, session.params, state, held=session.held_detaches())
    evaluator.group = group
    notes = evaluator.notes
    with recompute.exact_conditions() as entered:
        reference = evaluator.reference(with_inputs=False, vectorising=False)
    own = autocast_path.own_autocast(entered, autocast_path.device_type(params))
    if setting.autocast is None and own is not None:  # the model's own region: the path's precision, said by its code
        setting.autocast, plan = own, autocast_path.replanned(plan, own)
        said = autocast_path.own_note(own, autocast_path.device_type(params))
        notes.append(said)
    reference = dataclasses.replace(reference, loss=_rank_mean(reference.loss, group))
    edited = [parameter.path for parameter in state.guard.edited]
    if edited:  # every evaluation starts where training left the parameters, and the loss moves them from there
        shown = ", ".join(edited[:6]) + (f" and {len(edited) - 6} more" if len(edited) > 6 else "")
        text = (
            f"no probe made: the loss changes {shown} itself (in place, rebound or requires_grad toggled), so the "
            "window's loss evaluated again is not the function training differentiated at this point"
        )
        notes.append(Note(NoteCode.APPLIED_EDITED, text))
        return _Outcome(evaluator, [], None, reference.loss, 1, [0.0] * len(params))
    if unrecorded_randomness(state, setting.rng_states, notes):
        return _Outcome(evaluator, [], None, reference.loss, 1, [0.0] * len(params))
    eager = recompute.rank_mean(
        [g if g is not None else torch.zeros_like(p) for g, p in zip(reference.param_grads, params, strict=True)],
        group,
    )
    backward = 1
    again = None
    path_dtype = plan.path_dtype
    if setting.autocast is not None or setting.compiled:
        path_loss, again = setting.gradient()
        path_loss = _rank_mean(path_loss, group)
        backward += 1
        if abs(path_loss - reference.loss) > center_tolerance(reference.loss, path_dtype, path_dtype):
            notes.append(
                Note(
                    NoteCode.APPLIED_PATH_DIFFERS,
                    f"no probe made: the training's path computes another loss ({path_loss:.9g}) than its eager "
                    f"evaluation ({reference.loss:.9g}); compiled code draws its own random numbers (dropout), "
                    "which an eager evaluation cannot replay (torch._inductor.config.fallback_random = True makes "
                    "them eager's)",
                )
            )
            return _Outcome(evaluator, [], None, reference.loss, backward, [0.0] * len(params))
    if setting.path is None and setting.autocast is None:  # a 16-bit path no one named?
        inferred = autocast_path.reproducing_autocast(setting, plan.applied, again if again is not None else eager)
        backward += inferred.backward
        if inferred.setting is not None and inferred.gradient is not None and inferred.note is not None:
            setting, again, said = inferred.setting, inferred.gradient, inferred.note
            assert setting.autocast is not None
            plan, path_dtype = autocast_path.replanned(plan, setting.autocast), setting.autocast
            notes.append(said)
    if setting.autocast is not None:
        assert again is not None
        measured_floors: list[list[float]] | None = autocast_path.autocast_floors(setting, eager, again)
        plan = dataclasses.replace(plan, eager=eager)  # each tensor held against eager's (.measured.off_eager)
        backward += 2
    elif sharding_active() is not None:  # no float64 on shards: the float32 backward's own rounding, as on 16 bits
        scaled = recompute.eager_gradient(model, setting.batches, window, params, state, scale=SPREAD_SCALE)
        measured_floors = [distances(eager, scaled)]
        backward += 1
    else:  # a TF32 path's floor now (.reduced_float32); else only if a probe needs it (.lazy_floor)
        backward += (measured_floors := tf32_floors(setting, eager, notes)) is not None
    applied_norms = norms(plan.applied, exact=True)
    floor_values = floors(measured_floors or [], applied_norms, path_dtype)
    screens, lazy = dict[Any, Any](), measured_floors is None
    measured = measure(evaluator, plan, floor_values, reference.loss, screens, lazy)
    if measured_floors is None and lazy_floor.needed(measured):
        measured_floors, rounding = lazy_floor.float64_rounding(model, setting.batches, window, params, state, group,
                                                                eager, plan.applied, notes)  # fmt: skip
        backward += 1 if measured_floors else 0
        floor_values = floors(measured_floors, applied_norms, path_dtype)
        measured = measure(evaluator, plan, floor_values, reference.loss, screens, rounding=rounding)
    failing = [m for m in measured if m.probe.verdict == "fail"]
    floor_note = lazy_floor.floor_note(
        path_dtype, floor_values, applied_norms, plan.multiple, measured_floors is not None
    )
    notes.extend([floor_note, *unresolved_note(measured, evaluator.value_dtype)])
    attribution = attribute(setting, plan, eager, failing, floor_values, again) if failing else None
    return _Outcome(evaluator, measured, attribution, reference.loss, backward, floor_values)
