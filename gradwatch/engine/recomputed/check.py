"""One gradient check of a model on a batch: :func:`check_gradients`.

The check is a measurement plan run in a check session (:mod:`.session`: the parameters, the state captured and put
back, the notes and the report, as for every check) over the engine's parts:

1. the **reference** (:mod:`.reference`): the loss and autograd's gradient on the first samples of the batch, and the
   test that the loss evaluated again there is the same function;
2. the **portfolio** (:mod:`.probing.portfolio`): which probes, sized from the reference gradient;
3. the **ladder** (:mod:`.probing.ladder`): how each probe escalates from a two-point screen to a confirmed failure, so
   that a healthy model costs a fixed, small number of loss evaluations and a broken one what it takes to be sure;
4. the **measuring service** (:mod:`.measuring.points`): the loss at the points the probes ask for, in vectorised
   passes where it can (:mod:`.measuring.vectorized`);
5. the **loss as a deterministic function** (:mod:`.function`): random states replayed, buffers restored, float64
   storage and reductions, probe conditions.

Whatever happens, the model's parameters, buffers, ``.grad``, random states and modes are left exactly as they were.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack

from gradwatch.engine import validation as validate
from gradwatch.engine.culprits.upstream import CustomBackwards, latent_upstream_bug
from gradwatch.engine.distributed import SHARDED_NOTE, tensor_parallel
from gradwatch.engine.distributed.collective import Collective
from gradwatch.engine.function.batch import batch_size
from gradwatch.engine.function.conditions import autocast_disabled, probe_conditions
from gradwatch.engine.function.evaluation import LossFn
from gradwatch.engine.function.memory import affordable_samples, learn_activations, surviving_out_of_memory
from gradwatch.engine.function.precision import ResolvedPrecision, resolve_precision
from gradwatch.engine.function.sixteen_bit import SIXTEEN_BIT
from gradwatch.engine.function.twin import TWIN_NOTE, float32_twin, is_sixteen_bit, promoted_batch
from gradwatch.engine.numerics.norms import norms
from gradwatch.engine.numerics.steps import (
    UNCHECKABLE_TOLERANCE,
    gradient_tolerance,
    least_precise,
    relative_tolerance,
)
from gradwatch.engine.probing.outcome import Outcome, overall_verdict
from gradwatch.engine.probing.plan import ProbePlan
from gradwatch.engine.probing.portfolio import PortfolioTurn
from gradwatch.engine.probing.search_budget import SearchBudget
from gradwatch.engine.recomputed.collective_loss import in_lockstep_for_collective_losses
from gradwatch.engine.recomputed.compiled import compiled_culprit, compiled_parts, compiled_probes
from gradwatch.engine.recomputed.layout import disagreeing_replicas, refusing_losses_written_for_shards
from gradwatch.engine.recomputed.nonfinite import measured_nonfinite
from gradwatch.engine.recomputed.probes import measured_probes
from gradwatch.engine.recomputed.reference import nonfinite_probes, reference_on_a_slice, without_edited
from gradwatch.engine.recomputed.sixteen_bit_kernels import kernel_culprit, kernel_probes
from gradwatch.engine.results.kinds import Verdict
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import CheckReport, SearchProgress
from gradwatch.engine.selection import known_focus, refuse_meta, unmatched_patterns
from gradwatch.engine.session import CheckSession
from gradwatch.engine.settings import ProbeOptions, ProbeSettings
from gradwatch.errors import passes_fallbacks

__all__ = ["check_gradients"]


@validate.suggests_options(ProbeOptions)
@refusing_losses_written_for_shards
@in_lockstep_for_collective_losses
def check_gradients(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    step: int = 0,
    focus: Sequence[str] = (),
    rotation: int | None = None,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    settings: ProbeSettings | None = None,
    search_budget: SearchBudget | None = None,
    **options: Unpack[ProbeOptions],
) -> CheckReport:
    """Check that autograd's gradient of ``loss_fn(model, batch)`` is the derivative of the loss.

    Args:
        model: The module whose trainable floating parameters are checked (a DeepSpeed engine: the module it wraps,
            under ZeRO-3 with its parameters gathered; every rank calls the check together).
        batch: Anything ``loss_fn`` accepts; its floating tensors (found inside tuples, lists, dicts, namedtuples and
            dataclasses) are probed as inputs. It is never modified.
        loss_fn: ``loss_fn(model, batch) -> scalar Tensor``. A check evaluates it at least
            ``6 + 2 × (tensor_probes + random_probes + param_probes + input_probes)`` times (24 by default), more for
            screens that need a full stencil, with the random state replayed each time so dropout draws the same masks.
            In vectorised passes one call, under ``torch.func.vmap``, evaluates many points.
        step: The training step, recorded on the report and used to draw the probed coordinates and directions.
        focus: Names of parameters to probe along their gradient in this check besides the tensors whose turn it is: in
            a series of checks, the previous report's :attr:`~gradwatch.engine.results.report.CheckReport.undecided`,
            so that a tensor whose probe could not decide (it crossed a kink) is looked at again at the next point.
        rotation: Which window of tensors the probes cover (see :mod:`gradwatch.engine.probing.sampling`); defaults to
            ``step``. A caller running a series of checks passes the check's position in the series.
        optimizers: Optimizers whose state the check puts back if the loss changes it (steps them, changes a learning
            rate): an optimizer or a list of them. Any optimizer the loss steps is put back in any case; one it changes
            otherwise only if given here. See :mod:`gradwatch.engine.function.optimizers`.
        settings: The probe options as one :class:`~gradwatch.engine.settings.ProbeSettings` (what
            :class:`~gradwatch.GradientWatch` passes, built once for a whole run); then none one by one.
        search_budget: A cap on a failing check's culprit search, in training steps, and where an earlier check's
            search left off (a :class:`~gradwatch.engine.probing.search_budget.SearchBudget`; what a series of checks
            passes, its cap ``max_culprit_search_steps``). ``None`` (the default): the search goes on to the end
            (within its own limits of 64 probes and 240 loss evaluations), from the loss. A search its cap stopped
            leaves the verdict as it is, names the deepest module it proved to hold the bug and says where it stopped
            (:attr:`~gradwatch.engine.results.report.CheckReport.culprit_search`).
        **options: The probe options one by one (``tensor_probes``, ``precision``, ``ignore``, ``rtol``, ...): the
            fields of :class:`~gradwatch.engine.settings.ProbeSettings`, where each is documented with its default.

    Whatever the loss does to the model during the check is undone before it returns or raises: parameters changed in
    place, hooks registered, submodules added or replaced, parameters rebound, ``requires_grad`` toggled (see
    :mod:`gradwatch.engine.function.guard`), besides the user state of :mod:`gradwatch.engine.function.sandbox`. What
    cannot be undone is named in :attr:`~gradwatch.engine.results.report.CheckReport.unrestored` and in an
    :class:`~gradwatch.engine.results.report.UnrestoredStateWarning`.

    Returns:
        A :class:`~gradwatch.engine.results.report.CheckReport`. ``report.verdict`` is ``"fail"`` if any probe failed.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``loss_fn`` is not callable or does not return a tensor.
        ValueError: An argument is out of range, ``model`` or ``batch`` is on the ``meta`` device, or ``loss_fn``
            returns a non-scalar or a loss without a graph, or calls ``backward()`` itself
            (:class:`~gradwatch.engine.function.backward.LossCallsBackwardError`).

    Example:
        >>> import torch
        >>> from gradwatch import check_gradients
        >>> model = torch.nn.Linear(4, 2)
        >>> batch = (torch.randn(8, 4), torch.randn(8, 2))
        >>> report = check_gradients(model, batch, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
        >>> report.verdict
        'ok'
    """
    with CheckSession.open(model, loss_fn, step=step, settings=settings, options=options,
                           optimizers=optimizers) as session:  # fmt: skip
        focus = validate.check_patterns("focus", focus)
        validate.check_optional_int("rotation", rotation, minimum=0)
        refuse_meta(session.model, batch)
        return _check(session, batch, loss_fn, focus, rotation, search_budget)


def _check(
    session: CheckSession, batch: Any, loss_fn: LossFn, focus: tuple[str, ...], rotation: int | None,
    search_budget: SearchBudget | None = None,
) -> CheckReport:  # fmt: skip
    """The recomputed check's measurement plan, in its session: :func:`check_gradients` once its arguments are
    validated."""
    model, settings, surrogates = session.model, session.settings, session.surrogates
    session.quantisers_as_identity()  # the rest of the model checked on the float function the quantisers round
    for message in unmatched_patterns(settings.ignore, [name for name, _ in model.named_parameters()]):
        warnings.warn(message, UserWarning, stacklevel=3)
    focus, focus_notes = known_focus(focus, model)
    params = session.select()
    if not any(p.requires_grad and p.is_floating_point() for p in model.parameters()):
        text = (
            f"{type(model).__name__} has no trainable floating-point parameter (frozen, or layers kept in a plain "
            "list or dict, which are not registered): only the gradient in the batch's inputs is checked"
        )
        session.leading.append(Note(NoteCode.NO_TRAINABLE_PARAMETER, text))
        warnings.warn(f"gradwatch: {text}", UserWarning, stacklevel=5)  # the caller of check_gradients
    dtype = least_precise([p.dtype for _, p in params])
    floating_elements = sum(p.numel() for p in model.parameters() if p.is_floating_point())
    mode = resolve_precision(settings.precision, dtype, floating_elements)
    vectorize = settings.vectorize
    if session.collective is not None:
        sharding_notes, mode, vectorize = _sharded_settings(session.collective, mode)
        session.leading += sharding_notes
    session.leading += focus_notes
    plan = ProbePlan(
        portfolio=PortfolioTurn(
            dataclasses.replace(settings, input_probes=0) if surrogates.fake_quantisers else settings,
            step=session.step,
            rotation=session.step if rotation is None else rotation,
            focus=focus,
            exempt={name: mask for name, mask in surrogates.exempt.items() if name in dict(params)},
        ),
        rtol=settings.rtol if settings.rtol is not None else relative_tolerance(dtype),
        native_dtype=dtype,
        float64_refinement=settings.precision == "auto"
        and mode == "native"
        and dtype != torch.float64
        and session.collective is None,
        vectorize=vectorize,
        fail_on_imprecise=settings.fail_on_imprecise,
        precision=mode,
        measure_floor=settings.rtol is None,
        check_formula=settings.rtol is None,
        priced=settings.precision == "auto" and session.collective is None,
        search_budget=search_budget,
    )
    wanted = settings.probe_batch_size or batch_size(batch) or 0
    # ranks in lockstep (sharded, tensor-parallel) must not decide apart on their own free memory
    lockstep = session.collective is not None or tensor_parallel.replicas_group() is not None
    samples, why = (wanted, "") if lockstep else affordable_samples(model, [p for _, p in params], wanted, 1)
    if why and not samples:  # estimated before starting: no out-of-memory error to survive
        text = f"no probe made: the check would not fit in the device's free memory ({why}); the next check tries again"
        return session.report(verdict=Verdict.INCONCLUSIVE, probes=[], loss=math.nan, precision=mode,
                              notes=[Note(NoteCode.MEMORY_POSTPONED, text)])  # fmt: skip
    if why:
        session.settings = dataclasses.replace(settings, probe_batch_size=samples)
        text = f"probes use {samples} sample(s), not {wanted}: more would not fit in the device's free memory ({why})"
        session.leading.append(Note(NoteCode.MEMORY_SHRUNK, text))
    with surviving_out_of_memory(mode, next((p.device for _, p in params), None)) as ran_out, session.measuring():
        outcome = _run(session, batch, loss_fn, plan)
    if ran_out:  # the state is back, what the check allocated freed; the next check of a run is made cheaper
        return session.report(verdict=Verdict.INCONCLUSIVE, probes=[], loss=math.nan, notes=ran_out, precision=mode)
    if overall_verdict(outcome.probes) == Verdict.FAIL and is_sixteen_bit(model) and session.collective is None:
        own = (outcome.culprits, outcome.culprit_message, outcome.culprit_search)
        culprits, message, progress = _culprits_of_twin(session, batch, loss_fn, own, search_budget)
        outcome = dataclasses.replace(outcome, culprits=culprits, culprit_message=message, culprit_search=progress)
    report = session.report(
        **outcome.report_fields(),
        n_backward=outcome.evaluator.n_backward,
        n_passes=outcome.evaluator.n_passes,
        samples=batch_size(outcome.probe_batch),
        precision=outcome.precision,
        vectorized=outcome.vectorized,
        rtol=outcome.rtol,
        probed_inputs=outcome.probed_inputs,
    )
    for latent in report.noted(NoteCode.UPSTREAM_IGNORED):  # right as training weights it: a warning, no verdict
        warnings.warn(f"gradwatch: {latent}", UserWarning, stacklevel=4)
    return report


def _sharded_settings(collective: Collective, mode: ResolvedPrecision) -> tuple[list[Note], ResolvedPrecision, bool]:
    """A sharded check's (FSDP2, tensor parallelism) notes, precision and vectorisation: native probes of the global
    loss, one point per forward pass, every rank in lockstep."""
    notes = [
        Note(
            NoteCode.SHARDED,
            f"{SHARDED_NOTE} {collective.world} ranks: the global loss (the mean of the ranks' losses) along global "
            "directions, each rank moving its own shards and inputs; probes in the native precision, one point per "
            "forward pass; no input coordinate probes and no culprit search",
        )
    ]
    if mode == "float64":
        why = "FSDP gathers parameters in their own dtype"
        notes.append(Note(NoteCode.SHARDED_NATIVE, f"float64 probes are not made on shards ({why})"))
    return notes, "native", False


def _culprits_of_twin(
    session: CheckSession, batch: Any, loss_fn: LossFn, own: tuple[list[str], str, SearchProgress | None],
    search_budget: SearchBudget | None,
) -> tuple[list[str], str, SearchProgress | None]:  # fmt: skip
    """The culprits of a failing check of a 16-bit model, from its float32 twin (:mod:`..function.twin`) where the
    twin's check fails too: the search's probes of module inputs and outputs there stand above the arithmetic's error,
    where in 16 bits they may not decide, or end at a wrong place. Where the twin passes, the fault lives in the 16-bit
    arithmetic alone (a kernel wrong only in bfloat16) and the model's own search stands. A note says which."""
    twin = float32_twin(session.model)
    try:
        found = check_gradients(twin, promoted_batch(batch), loss_fn, step=session.step, settings=session.settings,
                                search_budget=search_budget)  # fmt: skip
    except Exception as error:  # the verdict stands; the model's own search with it
        if passes_fallbacks(error):
            raise
        text = f"no float32 twin search: its check raised {type(error).__name__} ({error})"
        session.trailing.append(Note(NoteCode.CULPRIT_ABANDONED, text))
        return own
    if found.verdict != Verdict.FAIL:
        return own
    session.trailing.append(Note(NoteCode.CULPRIT_FLOAT32_TWIN, TWIN_NOTE))
    return found.culprits, found.culprit_message, found.culprit_search


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Outcome(Outcome):
    """What the measuring part of a recomputed check produced, besides what every check's does."""

    probe_batch: Any
    precision: str
    vectorized: bool | None
    rtol: float
    probed_inputs: tuple[str, ...]


def _run(session: CheckSession, batch: Any, loss_fn: LossFn, plan: ProbePlan) -> _Outcome:
    """The reference, the probes (unless the reference rules them out), and for a compiled model the comparison of
    its compiled gradient with eager autograd's; the caller restores the state."""
    notes: list[Note] = []
    used_precision, vectorized = "native", None
    surrogates: tuple[str, ...] = ()
    culprits: list[str] = []
    culprit_message = ""
    progress = None
    model, state = session.model, session.state
    assert state is not None, "a check's measurements run inside session.measuring()"
    with probe_conditions():
        custom = CustomBackwards(loss_fn)  # a backward someone wrote in the reference's graph (for its linearity)
        started = time.perf_counter()
        evaluator, reference, probe_batch = reference_on_a_slice(
            session, batch, custom, with_inputs=plan.portfolio.probes.input_probes > 0, notes=notes
        )
        evaluator.loss_fn, evaluator.refused_function = loss_fn, custom.refused
        reference_seconds = time.perf_counter() - started  # a training step's work on the probe batch
        itemsize = max((p.element_size() for _, p in session.params), default=4)
        learn_activations(model, evaluator.saved_elements * itemsize, batch_size(probe_batch))  # the next one's peak
        if plan.priced:  # what float64 probes are priced against
            plan = dataclasses.replace(plan, step_seconds=reference_seconds)
        if plan.search_budget is not None:  # a training step's stand-in where the caller knows none: the reference
            # scaled from the probe slice to the whole batch
            sliced, whole = batch_size(probe_batch), batch_size(batch)
            plan.search_budget.stand_in(reference_seconds * (whole / sliced if sliced and whole else 1.0))
        evaluator.notes[:0] = notes
        evaluator.notes += state.sandbox.notes(())
        params, reference = without_edited(evaluator, session.params, reference, state.guard.edited_ids())
        grads = [
            g if g is not None else p.new_zeros(()) for (_, p), g in zip(params, reference.param_grads, strict=True)
        ]
        grad_norms = norms(grads, exact=True)
        probes = nonfinite_probes(reference, params, grad_norms)
        if probes and session.collective is None:  # measured against the loss's differences, traced to a module
            nonfinite = measured_nonfinite(model, evaluator, reference, params)
            probes, culprits, culprit_message = nonfinite.probes, nonfinite.culprits, nonfinite.message
            evaluator.notes += nonfinite.notes
        asked = plan.rtol
        plan = dataclasses.replace(plan, rtol=gradient_tolerance(asked, reference.loss, plan.native_dtype))
        # tensor parallelism: every rank compares, so that ranks of a group whose gradients differ stop together
        replicas = disagreeing_replicas(probe_batch, params, grad_norms, plan.rtol, evaluator.notes)
        probes = probes or replicas
        if not probes and plan.rtol > max(asked, UNCHECKABLE_TOLERANCE):
            evaluator.notes.append(Note(NoteCode.LOSS_NEAR_ZERO, (
                f"no probe made: the loss ({reference.loss:.3g}) is so close to zero that the rounding of its "
                f"{str(plan.native_dtype).removeprefix('torch.')} gradient alone may reach "
                f"{plan.rtol:.0%}")))  # fmt: skip
        elif not probes:
            measured = measured_probes(evaluator, reference, grad_norms, plan)
            probes, used_precision, vectorized = measured.probes, measured.precision, measured.vectorized
            plan = dataclasses.replace(plan, rtol=measured.rtol)
            surrogates = measured.surrogates
            culprits, culprit_message, progress = measured.culprits, measured.culprit_message, measured.culprit_search
            if evaluator.refused_by is not None and plan.native_dtype in SIXTEEN_BIT and session.collective is None:
                own = kernel_probes(model, evaluator, evaluator.refused_by)  # its module alone, in 16 bits
                probes += own
                named, message = kernel_culprit(model, own)
                culprits, culprit_message = (named, message) if named else (culprits, culprit_message)
            if custom.found is not None and overall_verdict(probes) != Verdict.FAIL and session.collective is None:
                latent = latent_upstream_bug(model, evaluator, reference.param_grads)  # right at weight 1 only
                evaluator.notes += [latent] if latent is not None else []
    if (
        session.collective is None
        and compiled_parts(model)
        and math.isfinite(plan.rtol)
        and not any(p.reason == "nonfinite" for p in probes)
    ):
        with autocast_disabled():  # the global settings training compiled its graph under, as a hook sees them
            probes += compiled_probes(model, batch, loss_fn, params, state, plan.rtol, notes=evaluator.notes)
        if not culprits:
            culprits, culprit_message = compiled_culprit(model, probes)
    return _Outcome(
        evaluator=evaluator,
        loss=reference.loss,
        probe_batch=probe_batch,
        probes=probes,
        precision=used_precision,
        vectorized=vectorized,
        rtol=plan.rtol,
        surrogates=surrogates,
        culprits=culprits,
        culprit_message=culprit_message,
        probed_inputs=tuple(reference.input_grads),
        culprit_search=progress,
    )
