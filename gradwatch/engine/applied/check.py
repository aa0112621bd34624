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
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.engine import validation as validate
from gradwatch.engine.applied import gradients as recompute
from gradwatch.engine.applied import lazy_floor
from gradwatch.engine.applied.attribution import Attribution, PathSetting, attribute
from gradwatch.engine.applied.equivalence import compare_accumulation
from gradwatch.engine.applied.probes import Measured, measure
from gradwatch.engine.applied.sharded import shard_window
from gradwatch.engine.applied.verdict import SPREAD_SCALE, distances, floor_multiple, floors
from gradwatch.engine.applied.window import COMBINES, Checksums, Combine, PathContext, single_loss
from gradwatch.engine.check import check_gradients
from gradwatch.engine.compiled import compiled_parts
from gradwatch.engine.function.conditions import warnings_withheld
from gradwatch.engine.function.evaluation import LossEvaluator, LossFn
from gradwatch.engine.function.optimizers import check_optimizers
from gradwatch.engine.function.state import TrainingState
from gradwatch.engine.function.surrogates import as_autograd_sees_them, find_stock_surrogates
from gradwatch.engine.kinds import ProbeKind, Reason, Verdict
from gradwatch.engine.notes import Note, NoteCode
from gradwatch.engine.numerics.norms import norms
from gradwatch.engine.numerics.steps import center_tolerance
from gradwatch.engine.report import CheckAbandonedError, CheckReport, Probe
from gradwatch.engine.selection import checked_parameters
from gradwatch.engine.sharding.collective import active as sharding_active
from gradwatch.engine.sharding.collective import sharded
from gradwatch.engine.sharding.parameters import is_sharded, lockstep

__all__ = ["check_applied_gradient", "path_autocast"]


def path_autocast(path: PathContext | None) -> torch.dtype | None:
    """The autocast dtype the path's context enables (on any device), or ``None``."""
    if path is None:
        return None
    with path():
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                return torch.get_autocast_dtype(device)
    return None


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
    tensor_probes: int | None = None,
    rotation: int = 0,
    culprit_search: bool = True,
    loss_scale: float = 1.0,
    ignore: Sequence[str] = (),
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    compare_one_batch: bool = True,
) -> CheckReport:
    """Check the gradient the optimizer is about to apply against central differences of the window's loss.

    Args:
        model: The module whose trainable floating parameters the optimizer updates.
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
        tensor_probes: Tensors probed along their own applied gradient per check, in turn (``None``: every tensor);
            every tensor when the descent probe fails.
        rotation: Which window of tensors the probes cover (the check's position in a series).
        culprit_search: For a formula fault, run :func:`~gradwatch.check_gradients` on the first micro-batch to name
            the module whose backward is wrong.
        ignore: Shell-style patterns of parameter names not to check (straight-through estimators: their gradient is
            not the derivative by design). Stock surrogates (spectral norm's power iteration, padding rows, embeddings
            with ``scale_grad_by_freq``) are handled as :func:`~gradwatch.check_gradients` handles them.
        optimizers: Optimizers whose state the check puts back if the loss changes it (a learning rate decayed inside
            the loss, say), as :func:`~gradwatch.check_gradients` does.
        loss_scale: The factor a float16 loop scales its loss by (``GradScaler.get_scale()``): recomputations of the
            path scale it alike, so that its float16 gradients do not underflow where training's did not.
        compare_one_batch: For a window of several micro-batches, compare the accumulated gradient with the gradient
            of its samples taken as one batch (:mod:`~gradwatch.engine.applied.equivalence`: two more backward passes):
            ``accumulation_scale`` and ``accumulation_cosine`` on the report, a warning note when they differ.

    Returns:
        A :class:`~gradwatch.CheckReport` with ``scope="applied"``; ``fault`` names the part of the path at fault when
        the check fails, ``noise_floor`` and ``floor_excess`` say how the verdict was calibrated.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module; got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable as loss_fn(model, batch); got {type(loss_fn).__name__}")
    batches = list(batches) if isinstance(batches, (list, tuple)) else None  # type: ignore[assignment]
    if not batches:
        raise ValueError("`batches` must be a non-empty list or tuple of the window's micro-batches")
    validate.check_choice("combine", combine, COMBINES, allow_callable=True)
    states = list(rng_states) if rng_states is not None else [None] * len(batches)
    if len(states) != len(batches):
        raise ValueError(f"`rng_states` must have one entry per micro-batch ({len(batches)}); got {len(states)}")
    validate.check_int("step", step, minimum=0)
    validate.check_optional_int("tensor_probes", tensor_probes, minimum=1)
    started = time.perf_counter()
    ignore = validate.check_patterns("ignore", ignore)
    protected = check_optimizers(optimizers)
    surrogates = find_stock_surrogates(model)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]
    applied_all = _applied(trainable, gradients)
    probed = {name for name, _ in checked_parameters(model, ignore, surrogates.unprobed)}
    chosen = [i for i, g in enumerate(applied_all) if g is not None and trainable[i][0] in probed]
    names = [trainable[i][0] for i in chosen]
    params: list[Tensor] = [trainable[i][1] for i in chosen]
    applied = [applied_all[i].detach() for i in chosen]  # type: ignore[union-attr]
    if start is not None and len(start.sums) == len(trainable):
        start = Checksums(tuple(start.sums[i] for i in chosen))
    unchecked = len(trainable) - len(chosen)
    notes: list[Note] = surrogates.notes()
    shards = None
    if params and is_sharded(list(zip(names, params, strict=True))):
        shards = shard_window(names, params, applied)  # FSDP2: this rank's rows, every rank checking together
        params, applied, group = shards.params, shards.applied, None
        notes.append(Note(NoteCode.SHARDED, shards.note()))
    if unchecked:
        text = f"{unchecked} trainable parameter(s) not checked (no gradient, ignore=, or not the derivative by design)"
        notes.append(Note(NoteCode.APPLIED_UNCHECKED, text))
    autocast = path_autocast(path)
    native = min((p.dtype for p in params), key=lambda d: torch.finfo(d).eps, default=torch.float32)
    path_dtype = autocast or native
    multiple = floor_multiple(path_dtype)
    base: dict[str, Any] = {"step": step, "loss": math.nan, "n_backward": 0, "scope": "applied"}
    if group is not None:
        disagreeing = _disagreeing_ranks(applied, group)
        if disagreeing:
            message = f"rank(s) {disagreeing} hold a different gradient than rank 0 after the reduction"
            probe = Probe(ProbeKind.DESCENT, "*", None, math.nan, math.nan, math.inf, Verdict.FAIL, math.nan, 0.0,
                          Reason.DISCREPANCY)  # fmt: skip
            return CheckReport(**base, verdict="fail", probes=[probe], n_forward=0,  # type: ignore[arg-type]
                               duration_s=time.perf_counter() - started, notes=notes, fault="reduction",
                               fault_message=message)  # fmt: skip
    if not (shards.finite() if shards is not None else all(bool(torch.isfinite(g).all()) for g in applied)):
        probe = Probe(ProbeKind.LOSS, "*", None, math.inf, math.nan, math.inf, Verdict.FAIL, math.nan, 0.0,
                      Reason.NONFINITE)  # fmt: skip
        return CheckReport(**base, verdict="fail", probes=[probe], n_forward=0,  # type: ignore[arg-type]
                           duration_s=time.perf_counter() - started, notes=notes, fault="unknown",
                           fault_message="the applied gradient holds non-finite values")  # fmt: skip
    state = TrainingState.capture(model, protected)
    setting = PathSetting(model, list(batches), loss_fn, states, combine, path, autocast, bool(compiled_parts(model)),
                          list[Tensor](params), state, group, start, loss_scale)  # fmt: skip
    collective = shards.collective if shards is not None else None
    with warnings_withheld() as withheld, as_autograd_sees_them(surrogates), sharded(collective):
        try:
            with lockstep(model, collective is not None):
                outcome = _measure(setting, names, applied, native, path_dtype, multiple, tensor_probes, rotation,
                                   notes)  # fmt: skip
                equivalence, said = None, list[Note]()
                if compare_one_batch and len(batches) > 1 and collective is None:
                    equivalence, said = compare_accumulation(
                        model,
                        batches,
                        loss_fn,
                        states,
                        combine,
                        params,
                        names,
                        state,
                        outcome[3] or [0.0] * len(params),
                        multiple,
                        group,
                    )
        finally:
            state.restore()
    measured, evaluator, attribution, _, loss, backward = outcome
    notes.extend(said)
    backward += 2 if equivalence is not None else 0
    if withheld:
        text = f"{len(withheld)} warning(s) raised during the check were not shown, the first: {withheld[0]}"
        notes.append(Note(NoteCode.WARNINGS_WITHHELD, text))
    culprits: list[str] = []
    culprit_message = ""
    surrogates_found: tuple[str, ...] = ()
    probes = [m.probe for m in measured]
    if attribution is not None and attribution.search_culprit:
        # today's check recognises straight-through estimators by their signature: tensors it calls surrogates are
        # not faults of the formula, and a check whose failures they explain is not a failure
        try:
            found = check_gradients(
                model, batches[0], single_loss(loss_fn, states[0], None), step=step, optimizers=protected
            )
        except CheckAbandonedError:
            raise
        except Exception as error:  # the verdict stands without it
            text = f"no culprit search: the recomputed check raised {type(error).__name__} ({error})"
            notes.append(Note(NoteCode.CULPRIT_ABANDONED, text))
            found = CheckReport(step=step, verdict=Verdict.OK, probes=[], loss=math.nan, n_forward=0, n_backward=0,
                                duration_s=0.0)  # fmt: skip
        surrogate = {p.target for p in found.probes if p.reason == Reason.SURROGATE}
        failing_targets = {p.target for p in probes if p.verdict == "fail"}
        if failing_targets and failing_targets <= surrogate:
            probes = [_undecided(p) if p.verdict == "fail" or p.target in surrogate else p for p in probes]
            surrogates_found, attribution = found.surrogates, None
        elif culprit_search:
            culprits, culprit_message = found.culprits, found.culprit_message
    descent = next((m for m in measured if m.probe.kind == ProbeKind.DESCENT), None)
    failing = any(p.verdict == "fail" for p in probes)
    return CheckReport(
        step=step,
        verdict=Verdict.FAIL
        if failing
        else (Verdict.OK if any(p.verdict == "ok" for p in probes) else Verdict.INCONCLUSIVE),
        probes=probes,
        loss=loss,
        n_forward=evaluator.n_forward if evaluator is not None else 0,
        n_backward=backward,
        n_passes=evaluator.n_forward if evaluator is not None else 0,
        duration_s=time.perf_counter() - started,
        notes=list(dict.fromkeys([*notes, *(evaluator.notes if evaluator is not None else [])])),
        precision="float64" if evaluator is not None and evaluator.value_dtype == torch.float64 else "native",
        rtol=math.nan,
        culprits=culprits,
        culprit_message=culprit_message,
        surrogates=surrogates_found,
        scope="applied",
        fault=attribution.fault if attribution is not None else None,
        fault_message=attribution.message if attribution is not None else "",
        noise_floor=_relative_floor(descent.probe if descent else None),
        floor_excess=max((m.excess for m in measured if math.isfinite(m.excess)), default=math.nan),
        accumulation_scale=equivalence.scale if equivalence is not None else math.nan,
        accumulation_cosine=equivalence.cosine if equivalence is not None else math.nan,
    )


def _undecided(probe: Probe) -> Probe:
    """A failing probe explained by a straight-through estimator: it measured a gradient that is not the derivative by
    design (``ignore=`` it to leave it out)."""
    return dataclasses.replace(probe, verdict=Verdict.INCONCLUSIVE, reason=Reason.SURROGATE)


def _applied(
    trainable: list[tuple[str, nn.Parameter]], given: Mapping[str, Tensor] | Sequence[Tensor] | None
) -> list[Tensor | None]:
    if given is None:
        return [p.grad for _, p in trainable]
    if isinstance(given, Mapping):
        unknown = sorted(set(given) - {n for n, _ in trainable})
        if unknown:
            raise ValueError(f"`gradients` must name trainable parameters of the model; got {unknown}")
        return [given.get(n) for n, _ in trainable]
    given = list(given)
    if len(given) != len(trainable):
        raise ValueError(
            f"`gradients` must have one tensor per trainable parameter ({len(trainable)}); got {len(given)}"
        )
    return list[Tensor | None](given)


def _disagreeing_ranks(applied: list[Tensor], group: Any) -> list[int]:
    """The ranks whose gradient checksums differ from rank 0's."""
    mine = Checksums.of(applied)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return [rank for rank, sums in enumerate(every) if rank and sums != every[0]]


def _measure(
    setting: PathSetting,
    names: list[str],
    applied: list[Tensor],
    native: torch.dtype,
    path_dtype: torch.dtype,
    multiple: float,
    tensor_probes: int | None,
    rotation: int,
    notes: list[Note],
) -> tuple[list[Measured], LossEvaluator | None, Attribution | None, list[float], float, int]:
    model, params, state, group = setting.model, setting.params, setting.state, setting.group
    named = list(zip(names, params, strict=True))
    evaluator = _GlobalEvaluator(model, setting.batches, setting.window(with_path=False), named, state)
    evaluator.group = group
    with recompute.exact_conditions():
        reference = evaluator.reference(with_inputs=False)
    reference = dataclasses.replace(reference, loss=_rank_mean(reference.loss, group))
    eager = recompute.rank_mean(
        [g if g is not None else torch.zeros_like(p) for g, p in zip(reference.param_grads, params, strict=True)],
        group,
    )
    backward = 1
    window = setting.window(with_path=False)
    again = None
    if setting.autocast is not None or setting.compiled:
        path_loss, again = recompute.path_gradient(model, setting.batches, setting.window(), params, state, group=group,
                                                   scale=setting.loss_scale)  # fmt: skip
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
            return [], evaluator, None, [], reference.loss, backward
    if setting.autocast is not None:
        assert again is not None
        emulated = recompute.emulated_gradient(model, setting.batches, window, params, state, setting.autocast, group)
        scaled = recompute.path_gradient(model, setting.batches, setting.window(), params, state, group=group,
                                         scale=SPREAD_SCALE * setting.loss_scale)[1]  # fmt: skip
        measured_floors = [distances(emulated, eager), distances(again, scaled)]
        backward += 2
    elif sharding_active() is not None:  # no float64 on shards: the float32 backward's own rounding, as on 16 bits
        scaled = recompute.eager_gradient(model, setting.batches, window, params, state, scale=SPREAD_SCALE)
        measured_floors = [distances(eager, scaled)]
        backward += 1
    else:
        measured_floors = None  # measured only if a probe needs it (.lazy_floor)
    applied_norms = norms(applied, exact=True)
    floor_values = floors(measured_floors or [], applied_norms, path_dtype)
    probe, screens, lazy = (setting.model, evaluator, named, applied), dict[Any, Any](), measured_floors is None
    measured = measure(*probe, floor_values, multiple, native, reference.loss, tensor_probes, rotation, screens, lazy)
    if measured_floors is None and lazy_floor.needed(measured):
        measured_floors = lazy_floor.float64_floor(model, setting.batches, window, params, state, group, eager, notes)
        backward += 1 if measured_floors else 0
        floor_values = floors(measured_floors, applied_norms, path_dtype)
        measured = measure(*probe, floor_values, multiple, native, reference.loss, tensor_probes, rotation, screens)
    floor_note = lazy_floor.floor_note(path_dtype, floor_values, applied_norms, multiple, measured_floors is not None)
    notes.append(floor_note)
    failing = [m for m in measured if m.probe.verdict == "fail"]
    attribution = None
    if failing:
        attribution = attribute(setting, applied, eager, failing, floor_values, multiple, again)
    return measured, evaluator, attribution, floor_values, reference.loss, backward


def _relative_floor(descent: Probe | None) -> float:
    """The path's noise floor along the descent probe relative to ``‖g‖`` (``nan`` without one)."""
    if descent is None or descent.floor is None or not descent.analytic:
        return math.nan
    return descent.floor / descent.analytic
