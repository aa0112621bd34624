"""The probes of an applied check: along the applied gradient itself, along every tensor's part of it at once, and
along each tensor's part of it when those two show an excess.

Two combined probes vouch for every tensor in four loss evaluations (besides the centre):

* the **descent** probe along ``ĝ`` over every tensor, which a fault scaling the whole gradient (accumulation, a loss
  scale) moves in full;
* the **tensors** probe along ``Σ_T ĝ_T / √N``, each tensor's own normalised gradient with equal weight, which a
  fault in one tensor moves by ``1/√N`` of that tensor's relative error, however small its share of ``‖g‖``
  (:mod:`.measured`).

Tensors they leave unvouched are probed in groups (:func:`~.measured.vouching_groups`), and the rest one by one along
their own ``ĝ_T``, in turn; so is every tensor when a combined probe does not agree well within its tolerance
(:data:`~.measured.CLOSER_LOOK`), and every one at once when one fails, so that the report names the tensors at fault.

**The closer look** (the float64 floor measured lazily, the group and tensor probes) is three quarters of a healthy
first check on the CIFAR CNN of ``benchmarks/overhead.py`` (20 training steps of 30). A check planned without it
(:attr:`~.path.AppliedPlan.closer_look` ``False``: a watch's first, which no budget bounds) stops after the combined
probes when every one **agrees** and no tensor's known rounding is beyond half its own tolerance
(:meth:`~.measured.Rounding.beyond`): the verdict is theirs (the measured floor only widens every tolerance), and the
note :data:`~gradwatch.engine.results.notes.NoteCode.APPLIED_CLOSER_LOOK_DEFERRED` says what was looked at, for the
watch to make a full check when its budget affords one (:meth:`gradwatch.watch.cadence.Cadence.owe`). A combined probe
that does not agree is never left: a real fault fails at this check as it would have.

Each probe's directions and steps: :mod:`.directions`; its stencils, from a screen on, are the ladder's
(:mod:`gradwatch.engine.probing.ladder`), judged against the path's floor (:class:`~.verdict.FloorJudge`), on the
window's measuring service (:mod:`.window_points`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from gradwatch.engine.applied.directions import AppliedProbes, balanced_slopes
from gradwatch.engine.applied.gradients import exact_conditions, rank_means
from gradwatch.engine.applied.measured import (
    CLOSER_LOOK,
    Measured,
    Rounding,
    calm,
    off_eager,
    tensors_to_probe,
    unvouched,
    vouchers,
    vouching_groups,
)
from gradwatch.engine.applied.path import AppliedPlan
from gradwatch.engine.applied.window_points import WindowMeasurements
from gradwatch.engine.distributed.collective import active as sharding_active
from gradwatch.engine.function.complex_params import autograd_tensor
from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.function.memory import is_out_of_memory, release_memory
from gradwatch.engine.function.precision import (
    AUTO_FLOAT64_ELEMENTS,
    exact_source,
    float64_storage,
    float64_unaffordable,
    resolve_precision,
    substitute_of,
)
from gradwatch.engine.function.values import first_line
from gradwatch.engine.numerics.steps import center_tolerance
from gradwatch.engine.recomputed.faithfulness import FINE_AGREEMENT, FINE_CHANGE
from gradwatch.engine.results.kinds import ProbeKind
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.errors import NotReproducibleError, passes_fallbacks

__all__ = ["AppliedProbes", "Measured", "measure", "unresolved_note"]


def measure(evaluator: LossEvaluator, plan: AppliedPlan, floors: list[float], loss: float, *,
            screens: dict[Any, Any] | None = None, provisional: bool = False,
            rounding: Rounding | None = None) -> list[Measured]:  # fmt: skip
    """The probes of ``plan`` around the window's ``loss``, judged against the path's ``floors`` per tensor: on
    float64 storage where the model runs in float64 (else natively, float64 reductions).

    ``provisional``: the ``floors`` are a lower bound of the floor (:mod:`.measurement`): the probes stop at the first
    screen that does not agree, or after the combined probes when one does not agree within
    :data:`~.measured.CLOSER_LOOK`. ``screens`` collects the centre and the screens of one pass for another over the
    same point, which evaluates them again only if they are not there. ``rounding``: per tensor, the measured
    rounding's part along its applied gradient, which a closer look discounts (:mod:`.measured`)."""
    named = list(evaluator.params)
    elements = sum(p.numel() for _, p in named)
    screens = screens if screens is not None else {}
    probes_at = functools.partial(_probes_at, evaluator, plan, floors, loss, screens=screens, provisional=provisional,
                                  rounding=rounding)  # fmt: skip
    with exact_conditions():
        wanted = resolve_precision("auto", plan.native, elements) == "float64"
        unaffordable = float64_unaffordable(evaluator.model, evaluator) if wanted and plan.float64 else ""
        # the ranks of a group evaluate alike, or their collectives stop matching: float64 only if every rank can
        group = getattr(evaluator, "group", None)
        float64 = wanted and not rank_means([float(not plan.float64 or bool(unaffordable))], group)[0] > 0
        evaluator.probed_in = "native"
        if float64 and sharding_active() is not None:
            text = "float64 probes are not made on shards (FSDP gathers parameters in their own dtype)"
            evaluator.notes.append(Note(NoteCode.SHARDED_NATIVE, text))
        elif wanted and not float64:  # not tried: estimated before, or an earlier check's lesson (the watch says it)
            text = unaffordable or ("" if not plan.float64 else "another rank of the check cannot afford float64")
            evaluator.notes += [Note(NoteCode.MEMORY_NATIVE, f"probes run natively: {text}")] if text else []
        elif float64 and "quantised" not in screens:  # (a second pass over a quantised float64 loss)
            try:
                slopes = balanced_slopes(plan, [p for _, p in named])  # its float64 products before the float64 model
                with float64_storage(evaluator.model, _moved(evaluator.model, named)) as substitutes:
                    evaluator.params = [(n, substitute_of(p, substitutes)) for n, p in named]
                    evaluator.use_float64_inputs()
                    found = probes_at(torch.float64, slopes=slopes)
                    quantised = _quantised(evaluator, found, plan.applied, loss)
                    if quantised is None:
                        evaluator.probed_in = "float64"
                        return found
                    evaluator.notes.append(Note(NoteCode.APPLIED_NATIVE, f"probes run natively: {quantised}"))
                    screens["quantised"] = quantised
            except Exception as error:  # no float64 kernel, a tensor made in float32 inside, no memory for float64
                out_of_memory = is_out_of_memory(error)
                if passes_fallbacks(error) and not out_of_memory:
                    raise
                if out_of_memory:
                    release_memory(named[0][1].device if named else None, error)
                    text = f"probes run natively: float64 ran out of memory ({first_line(error)})"
                    note = Note(NoteCode.MEMORY_NATIVE, text)
                else:
                    text = f"probes run natively: the loss raised {type(error).__name__} in float64"
                    note = Note(NoteCode.APPLIED_NATIVE, text)
                evaluator.notes.append(note)
            finally:
                evaluator.params = named
                evaluator.use_native_inputs()
        return probes_at(plan.native)


FLOAT64_NOISE = 1e-6
"""A float64 probe whose own noise exceeds this fraction of its slope (float64 round-off at an applied check's step is
~1e-9 of it) makes the check verify that its loss was computed in float64 (:func:`_quantised`)."""


def _quantised(evaluator: LossEvaluator, found: list[Measured], applied: list[torch.Tensor], loss: float) -> str | None:
    """Why the float64 evaluations computed in a lower precision somewhere (a kernel that accepts float64 and computes
    float32, which :class:`~gradwatch.engine.function.fidelity.Float64Fidelity` cannot see), or ``None``; tested only
    where the loss's value is float64 and a probe's noise is beyond float64's. Along the applied gradient, at steps
    ``s`` and ``s / 2`` predicted to move the loss by :data:`~gradwatch.engine.recomputed.faithfulness.FINE_CHANGE` of
    it (far below a float32 ulp), a float64 function's central differences are the descent probe's own within
    :data:`~gradwatch.engine.recomputed.faithfulness.FINE_AGREEMENT`, whatever the gradient; a function rounded to
    float32 on the way moves by whole float32 ulps there, or not at all."""
    descent = next((m.probe for m in found if m.probe.kind == ProbeKind.DESCENT), None)
    noisy = any(m.probe.noise > FLOAT64_NOISE * max(abs(m.probe.analytic), 1e-300) for m in found)
    tensors = [p for _, p in evaluator.params]
    sources = [source for source in map(exact_source, tensors) if source is not None]  # put back from, exactly
    shapes = len(tensors) == len(applied) == len(sources) and all(
        t.shape == g.shape for t, g in zip(tensors, applied, strict=True)
    )
    if descent is None or not noisy or not shapes or evaluator.value_dtype != torch.float64:
        return None
    slope = math.sqrt(sum(float(g.to(torch.float64, copy=True).pow_(2).sum()) for g in applied))  # one copy at a time
    if slope == 0.0 or not math.isfinite(descent.numeric) or not math.isfinite(loss) or loss == 0.0:
        return None
    step = FINE_CHANGE * abs(loss) / slope
    differences = []
    with torch.no_grad():
        for h in (step, step / 2):
            values = []
            for sign in (1.0, -1.0):
                for t, g in zip(tensors, applied, strict=True):
                    t.add_(g.to(t.dtype), alpha=sign * h / slope)
                try:
                    values.append(evaluator.loss())
                finally:
                    for t, source in zip(tensors, sources, strict=True):
                        t.copy_(source)
            differences.append((values[0] - values[1]) / (2 * h))
    if max(abs(d - descent.numeric) for d in differences) <= FINE_AGREEMENT * max(abs(descent.numeric), slope):
        return None
    return (
        f"float64 evaluations are quantised: along the gradient, central differences at steps predicted to move the "
        f"loss by {FINE_CHANGE:.0e} of it measured {differences[0]:.4g} and {differences[1]:.4g}, at the descent "
        f"probe's step {descent.numeric:.4g}; somewhere the loss is computed in a lower precision that gradwatch "
        "cannot promote"
    )


def _moved(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> set[int] | None:
    """The parameters that get a float64 copy: all, unless the model is beyond the float64 limit (a LoRA adapter on a
    billion frozen parameters), where only the checked ones do and the rest are cast where used
    (:class:`~gradwatch.engine.function.precision.CastOnUse`)."""
    elements = sum(p.numel() for p in model.parameters() if p.is_floating_point() or p.is_complex())
    return {id(autograd_tensor(p)) for _, p in named} if elements > AUTO_FLOAT64_ELEMENTS else None


def _probes_at(evaluator: LossEvaluator, plan: AppliedPlan, floors: list[float], loss: float, compute: torch.dtype, *,
               screens: dict[Any, Any], provisional: bool, rounding: Rounding | None,
               slopes: dict[tuple[int, ...], tuple[float, float]] | None = None) -> list[Measured]:  # fmt: skip
    pending = compute == torch.float64 and compute not in screens  # (see :mod:`.window_points`)
    if compute not in screens and not pending:
        screens[compute] = evaluator.loss()
    center = screens.get(compute, screens.get("pair", loss))
    if not pending and abs(center - loss) > center_tolerance(loss, plan.native, compute):
        return _not_reproducible(evaluator, center, loss)
    measurements = WindowMeasurements(evaluator, center, reference=loss, native_dtype=plan.native, pending=pending,
                                      screens=screens)  # fmt: skip
    sizes = plan.applied_norms
    beyond = rounding.beyond(sizes, floors, plan.multiple) if rounding else []
    if plan.eager is not None:  # a 16-bit path: each tensor's applied gradient against eager's, at its own floor
        beyond = sorted(set(beyond) | set(off_eager(plan.applied, plan.eager, sizes, floors, plan.multiple)))
    discount = rounding.explained(beyond) if rounding else None  # (.measured)
    probes = AppliedProbes(measurements, plan, [p for _, p in evaluator.params], floors, provisional=provisional,
                           rounding=discount, slopes=slopes)  # fmt: skip
    try:
        return _probed(probes, beyond)
    except NotReproducibleError as error:
        return _not_reproducible(evaluator, error.center, loss)


def _not_reproducible(evaluator: LossEvaluator, center: float, loss: float) -> list[Measured]:
    evaluator.notes.append(
        Note(
            NoteCode.APPLIED_NOT_REPRODUCIBLE,
            f"no probe made: the window's loss is {center:.9g} when evaluated again, {loss:.9g} when "
            "differentiated; it draws randomness that was not recorded (pass rng_states) or is not a function "
            "of the parameters",
        )
    )
    return []


def _probed(probes: AppliedProbes, beyond: list[int]) -> list[Measured]:
    plan, floors, provisional = probes.plan, probes.floors, probes.provisional
    measured = [m for m in (probes.descent(), probes.balanced(), *probes.every_check()) if m is not None]
    if not plan.closer_look and not beyond and waits(measured, probes.grad_norms, floors, plan.multiple):
        note = deferred_note(measured, plan.names, probes.grad_norms, floors, plan.multiple, provisional=provisional)
        probes.measurements.evaluator.notes.append(note)  # a series' first check: its closer look waits
        return measured
    if provisional and not calm(measured):
        return measured
    if calm(measured):  # the tensors they leave unvouched, in groups a balanced probe over each would vouch for
        left = sorted(set(unvouched(vouchers(measured), probes.grad_norms, floors, plan.multiple)) - set(beyond))
        groups = [probes.balanced(g) for g in vouching_groups(left, probes.grad_norms, floors, plan.multiple)]
        measured += [m for m in groups if m is not None]
        if provisional and not calm(measured):
            return measured
    order = tensors_to_probe(vouchers(measured), probes.grad_norms, floors, plan.multiple,
                             tensor_probes=plan.tensor_probes, rotation=plan.rotation, also=beyond)  # fmt: skip
    for i in order:
        found = probes.tensor(i)
        if found is not None:
            measured.append(found)
            if provisional and found.probe.verdict != "ok":
                return measured
    if any(m.probe.verdict == "fail" for m in measured) and len(order) < len(plan.names):
        for i in sorted(set(range(len(plan.names))) - set(order)):  # name every tensor at fault
            found = probes.tensor(i)
            if found is not None:
                measured.append(found)
    return measured


def waits(measured: Sequence[Measured], grad_norms: Sequence[float], floors: Sequence[float], multiple: float) -> bool:
    """Whether a check planned without its closer look stops after the combined probes ``measured``: every one agrees,
    and the closer look would do something (a discrepancy above :data:`~.measured.CLOSER_LOOK`, tensors unvouched)."""
    if not measured or any(m.probe.verdict != "ok" for m in measured):
        return False
    uneasy = any(not m.closer <= CLOSER_LOOK for m in measured)
    return uneasy or bool(unvouched(vouchers(measured), grad_norms, floors, multiple))


def deferred_note(measured: Sequence[Measured], names: Sequence[str], grad_norms: Sequence[float],
                  floors: Sequence[float], multiple: float, *, provisional: bool) -> Note:  # fmt: skip
    """What a check that left its closer look (:func:`waits`) looked at and what it did not."""
    worst = max((m.excess for m in measured if math.isfinite(m.excess)), default=math.nan)
    left = unvouched(vouchers(measured), grad_norms, floors, multiple)
    shown = ", ".join(names[i] for i in left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
    kinds = " and ".join(dict.fromkeys(str(m.probe.kind) for m in measured))
    floor = "the storage rounding alone (float64 floor not measured)" if provisional else "the measured floor"
    vouching = (
        f"they vouch for every tensor at its own probe's resolution except {len(left)} of {len(names)} ({shown})"
        if left
        else f"they vouch for all {len(names)} tensors at their own probes' resolution"
    )
    return Note(
        NoteCode.APPLIED_CLOSER_LOOK_DEFERRED,
        f"the run's first applied check made its {kinds} probes only: they agree within their tolerance (largest "
        f"discrepancy {worst:.2f} of it) at {floor}; {vouching}; no tensor was probed one by one. The closer look "
        f"(float64 floor, tensor probes) is made at a later check, when the budget (max_overhead) affords it",
    )


def deferred(notes: Sequence[Note]) -> bool:
    """Whether a check's ``notes`` say it left its closer look for later."""
    return any(getattr(n, "code", None) == NoteCode.APPLIED_CLOSER_LOOK_DEFERRED for n in notes)


def unresolved_note(measured: list[Measured], value_dtype: torch.dtype) -> list[Note]:
    """A note naming the probes that could not resolve the gradient (reason ``unresolved``), with what would resolve
    them; none when every probe resolved."""
    unresolved = [m.probe for m in measured if m.probe.reason == "unresolved"]
    if not unresolved:
        return []
    worst = max(unresolved, key=lambda p: p.noise / max(abs(p.analytic), abs(p.numeric), 1e-300))
    shown = ", ".join(f"{p.kind} {p.target}" for p in unresolved[:4]) + (" ..." if len(unresolved) > 4 else "")
    dtype = str(value_dtype).removeprefix("torch.")
    text = (
        f"{len(unresolved)} probe(s) could not resolve the gradient ({shown}): their central differences carry a noise "
        f"comparable to the slope they measure (analytic {worst.analytic:.6g}, numeric {worst.numeric:.6g} ± "
        f"{worst.noise:.2g}), so they are undecided, not ok; the loss's value arrives in {dtype}: a loss returned in "
        "float64 (the computed tensor itself, not a float32 copy of it), or a check of the module alone "
        "(check_gradients on it), would resolve it"
    )
    return [Note(NoteCode.APPLIED_UNRESOLVED, text)]
