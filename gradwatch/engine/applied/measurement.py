"""The applied check's measurement plan, inside its session (:func:`measure_window`): the window's loss and eager
gradient (the ranks' mean under DDP), the training's path run again where it differs from eager float32 or must be
inferred (:mod:`.autocast_path`), the path's noise floor (:mod:`.verdict`), the probes (:mod:`.probes`) and a
failure's attribution (:mod:`.attribution`).

**The float32 floor, measured only when a probe needs it.** On a float32 (or float64) path a tensor's floor is the
larger of the storage rounding ``u · ‖g_T‖`` and the distance of the eager gradient from a float64 one, which costs a
float64 forward and backward of the window (on a CPU float64 convolution, about three training steps). The verdict is
monotone in the floor and the storage rounding is a lower bound of it, so probes that all agree against the storage
rounding alone agree against the measured floor too: the float64 backward (:func:`float64_rounding`) is made only when
a probe does not agree at first, and the probes are judged again against it. A 16-bit path measures its floor up front:
its storage rounding is far below what a correct gradient of the path is off by.

**A TF32 path** (:func:`tf32_floors`): on Ampere and later GPUs float32 matmuls run in TF32 where
``torch.backends.cuda.matmul.fp32_precision`` (or ``torch.set_float32_matmul_precision("high")``) says so, and cuDNN
convolutions and RNNs do by default in torch 2.13: about 1e-3 relative error against IEEE float32's 1e-7. The check's
own recomputations run in IEEE float32 (:func:`~.gradients.exact_conditions`), so a floor measured there would call
every healthy TF32 step a failure. Where the settings the check found
(:attr:`~gradwatch.engine.results.report.CheckReport.numerics`) run a path of the model's device in TF32, the floor is
the distance of the gradient under training's settings from the IEEE float32 one (one backward more, with a note),
and where a probe does not agree against it, also the IEEE float32 gradient's own distance from the float64 one, as on
a float32 path: a CPU whose oneDNN takes the TF32 setting and rounds a convolution's bias gradient only a little
differently leaves a TF32 distance below the float32 accumulation's rounding. A wrong backward is as wrong in TF32 as
in IEEE float32, and a 3% error stands far above a 1e-3 floor.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradwatch.engine.applied import autocast_path
from gradwatch.engine.applied import gradients as recompute
from gradwatch.engine.applied.attribution import Attribution, attribute
from gradwatch.engine.applied.measured import Rounding, calm, difference_dot
from gradwatch.engine.applied.path import AppliedPlan, CheckedWindow
from gradwatch.engine.applied.probes import Measured, deferred, measure, unresolved_note
from gradwatch.engine.applied.verdict import SPREAD_SCALE, distances, floors, storage_rounding
from gradwatch.engine.applied.window import unrecorded_randomness
from gradwatch.engine.function.batch import batch_size
from gradwatch.engine.function.copies import same_bits
from gradwatch.engine.function.evaluation import LossEvaluator, Reference
from gradwatch.engine.function.memory import learn_activations
from gradwatch.engine.numerics.steps import center_tolerance
from gradwatch.engine.probing.outcome import Outcome
from gradwatch.engine.results.kinds import Reason, Verdict
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.errors import own_error


class WindowEvaluator(LossEvaluator):
    """The evaluator of the window loss, averaged over the ranks of ``group`` (the loss DDP's mean differentiates)."""

    group: Any = None

    def loss(self) -> float:
        return recompute.rank_means([super().loss()], self.group)[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AppliedOutcome(Outcome):
    """What the measuring part of an applied check produced, besides what every check's does."""

    measured: list[Measured]
    attribution: Attribution | None
    backward: int
    floors: list[float]


@dataclasses.dataclass
class _Path:
    """The training's path as the measurements found it (an autocast path inferred replaces setting and plan), its own
    gradient where computed, and the backward passes spent."""

    setting: CheckedWindow
    plan: AppliedPlan
    again: list[Tensor] | None = None
    backward: int = 1
    tf32: bool = False  # the floor measured up front is TF32's against IEEE float32: float64 may still add to it


def measure_window(setting: CheckedWindow, plan: AppliedPlan) -> AppliedOutcome:
    """The applied check's measurement plan (see the module doc), inside its session."""
    session = setting.session
    evaluator = WindowEvaluator(setting.model, setting.batches, setting.window(with_path=False), session.params,
                                setting.state, held=session.held_detaches())  # fmt: skip
    evaluator.group = setting.group
    path = _Path(setting, plan)
    started = time.perf_counter()
    reference = _reference(path, evaluator)
    if setting.search_budget is not None:  # the window's forward and backward: a training step's work
        setting.search_budget.stand_in(time.perf_counter() - started)
    itemsize = max((p.element_size() for p in setting.params), default=4)
    window = sum(batch_size(b) or 0 for b in setting.batches)
    learn_activations(setting.model, evaluator.saved_elements * itemsize, window)  # the next check's peak
    if _not_the_trained_function(setting, evaluator.notes):
        return _nothing(path, evaluator, reference.loss)
    grads = zip(reference.param_grads, setting.params, strict=True)
    eager = recompute.rank_mean([g if g is not None else torch.zeros_like(p) for g, p in grads], setting.group)
    eager = _sharing(eager, plan.applied, setting)
    reference = dataclasses.replace(reference, param_grads=[])  # (``eager`` holds them)
    if not _path_reproduces(path, reference.loss, evaluator.notes):
        return _nothing(path, evaluator, reference.loss)
    _infer_autocast(path, eager, evaluator.notes)
    measured_floors = _measured_floors(path, eager, evaluator.notes)
    setting, plan = path.setting, path.plan
    applied_norms = plan.applied_norms
    floor_values = floors(measured_floors or [], applied_norms, plan.path_dtype)
    screens, lazy = dict[Any, Any](), measured_floors is None or path.tf32
    measured = measure(evaluator, plan, floor_values, reference.loss, screens=screens, provisional=lazy)
    if lazy and not calm(measured) and not deferred(evaluator.notes):  # a probe the storage rounding (or TF32's
        # distance) alone leaves uncalm (a first check whose combined probes agree leaves that to a later one)
        found, rounding = float64_rounding(setting, eager, plan.applied, evaluator.notes)
        measured_floors = [*(measured_floors or []), *found]  # a TF32 path's floor: the larger of both
        path.backward += 1 if found else 0
        floor_values = floors(measured_floors, applied_norms, plan.path_dtype)
        measured = measure(evaluator, plan, floor_values, reference.loss, screens=screens, rounding=rounding)
    failing = [m for m in measured if m.probe.verdict == "fail"]
    said = floor_note(plan.path_dtype, floor_values, applied_norms, plan.multiple, measured_floors is not None)
    evaluator.notes.extend([said, *unresolved_note(measured, evaluator.value_dtype)])
    attribution = attribute(setting, plan, eager, failing, floor_values, path.again) if failing else None
    if attribution is not None and attribution.fault in ("precision", "unknown") and setting.autocast is not None:
        tensors = sorted({i for m in failing for i in m.tensors})
        recurs, backward = autocast_path.disagreement_recurs(setting, plan, tensors)
        path.backward += backward
        if not recurs:
            measured, attribution = [_crossing(m) for m in measured], None
            evaluator.notes.append(Note(NoteCode.APPLIED_ROUNDING_CROSSING, _crossing_text(setting, tensors)))
    return AppliedOutcome(evaluator=evaluator, loss=reference.loss, probes=[m.probe for m in measured],
                          measured=measured, attribution=attribution, backward=path.backward,
                          floors=floor_values)  # fmt: skip


def _crossing(measured: Measured) -> Measured:
    """A failing probe of a 16-bit path whose disagreement did not recur at shifted points: undecided, a tie of the
    path's rounding (the next check probes its tensor again)."""
    if measured.probe.verdict != "fail":
        return measured
    undecided = dataclasses.replace(measured.probe, verdict=Verdict.INCONCLUSIVE, reason=Reason.TIE)
    return dataclasses.replace(measured, probe=undecided)


def _crossing_text(setting: CheckedWindow, tensors: list[int]) -> str:
    names = ", ".join(setting.session.params[i][0] for i in tensors[:4]) + (" and more" if len(tensors) > 4 else "")
    dtype = str(setting.autocast).removeprefix("torch.")
    return (
        f"the {dtype} path's gradient of {names} disagreed at this point only: at {autocast_path.SHIFTED_POINTS} "
        f"points shifted by {autocast_path.SHIFT:g} of each parameter it agreed with eager float32 within its floor, "
        f"so its rounding crossed a kink here (a ReLU input within its rounding of 0), which a wrong kernel would not "
        f"undo; undecided, probed again at the next check"
    )


def _nothing(path: _Path, evaluator: LossEvaluator, loss: float) -> AppliedOutcome:
    """The outcome of a window whose loss the check cannot probe (the notes say why)."""
    return AppliedOutcome(evaluator=evaluator, loss=loss, probes=[], measured=[], attribution=None,
                          backward=path.backward, floors=[0.0] * len(path.setting.params))  # fmt: skip


def _reference(path: _Path, evaluator: WindowEvaluator) -> Reference:
    """The window's loss (the ranks' mean) and eager gradient, in the check's exact conditions; a model that enters
    autocast itself gives the path its precision."""
    setting = path.setting
    with recompute.exact_conditions() as entered:
        reference = evaluator.reference(with_inputs=False, vectorising=False)
    device = autocast_path.device_type(setting.params)
    own = autocast_path.own_autocast(entered, device)
    if setting.autocast is None and own is not None:  # the model's own region: the path's precision, said by its code
        setting.autocast, path.plan = own, autocast_path.replanned(path.plan, own)
        said = autocast_path.own_note(own, device)
        evaluator.notes.append(said)
    return dataclasses.replace(reference, loss=recompute.rank_means([reference.loss], setting.group)[0])


def _sharing(grads: list[Tensor], applied: Sequence[Tensor], setting: CheckedWindow) -> list[Tensor]:
    """``grads`` with each tensor that holds the applied gradient's bits replaced by the applied tensor, so that the
    check holds one copy of the gradient, not two (a float32 path's eager gradient usually is the applied one, a
    16-bit path's own again); exact, as neither is written to. Not on shards or across ranks (other tensors there)."""
    if setting.session.collective is not None or setting.group is not None or len(grads) != len(applied):
        return grads
    return [a if same_bits(g, a) else g for g, a in zip(grads, applied, strict=True)]


def _not_the_trained_function(setting: CheckedWindow, notes: list[Note]) -> bool:
    """Whether the window's loss evaluated again is not the function training differentiated (with a note): the loss
    edits parameters itself, or draws randomness that was not recorded."""
    edited = [parameter.label for parameter in setting.state.guard.edited]
    if edited:  # every evaluation starts where training left the parameters, and the loss moves them from there
        shown = ", ".join(edited[:6]) + (f" and {len(edited) - 6} more" if len(edited) > 6 else "")
        text = (
            f"no probe made: the loss changes {shown} itself (in place, rebound or requires_grad toggled), so the "
            "window's loss evaluated again is not the function training differentiated at this point"
        )
        notes.append(Note(NoteCode.APPLIED_EDITED, text))
        return True
    return unrecorded_randomness(setting.state, setting.rng_states, notes)


def _path_reproduces(path: _Path, loss: float, notes: list[Note]) -> bool:
    """On a path that differs from eager float32 (autocast, compiled code): its gradient (kept as ``path.again``), and
    whether it computes the same loss (else a note, and no probe)."""
    setting, dtype = path.setting, path.plan.path_dtype
    if setting.autocast is None and not setting.compiled:
        return True
    path_loss, again = setting.gradient()
    path.again = _sharing(again, path.plan.applied, setting)
    path_loss = recompute.rank_means([path_loss], setting.group)[0]
    path.backward += 1
    if abs(path_loss - loss) <= center_tolerance(loss, dtype, dtype):
        return True
    notes.append(
        Note(
            NoteCode.APPLIED_PATH_DIFFERS,
            f"no probe made: the training's path computes another loss ({path_loss:.9g}) than its eager "
            f"evaluation ({loss:.9g}); compiled code draws its own random numbers (dropout), "
            "which an eager evaluation cannot replay (torch._inductor.config.fallback_random = True makes "
            "them eager's)",
        )
    )
    return False


def _infer_autocast(path: _Path, eager: list[Tensor], notes: list[Note]) -> None:
    """A 16-bit path no one named (:func:`~.autocast_path.reproducing_autocast`): adopted, with a note."""
    setting = path.setting
    if setting.path is not None or setting.autocast is not None:
        return
    inferred = autocast_path.reproducing_autocast(setting, path.plan.applied,
                                                  path.again if path.again is not None else eager)  # fmt: skip
    path.backward += inferred.backward
    if inferred.setting is not None and inferred.gradient is not None and inferred.note is not None:
        assert inferred.setting.autocast is not None
        path.setting, path.again = inferred.setting, _sharing(inferred.gradient, path.plan.applied, setting)
        path.plan = autocast_path.replanned(path.plan, inferred.setting.autocast)
        said = inferred.note
        notes.append(said)


def _measured_floors(path: _Path, eager: list[Tensor], notes: list[Note]) -> list[list[float]] | None:
    """The distances the path's floor is measured from up front (:func:`~.verdict.floors`): a 16-bit autocast path's,
    a sharded float32 path's backward spread, a TF32 path's; ``None`` where it waits for a probe that needs it."""
    setting = path.setting
    if setting.autocast is not None:
        assert path.again is not None
        path.plan = dataclasses.replace(path.plan, eager=eager)  # each tensor against eager's (.measured.off_eager)
        path.backward += 2
        return autocast_path.autocast_floors(setting, eager, path.again)
    if setting.session.collective is not None:  # no float64 on shards: the float32 backward's own rounding, as 16 bits
        path.backward += 1
        return [distances(eager, setting.eager(scale=SPREAD_SCALE))]
    found = tf32_floors(setting, eager, notes)  # a TF32 path's floor now
    path.backward += found is not None
    path.tf32 = found is not None
    return found


def float64_rounding(
    setting: CheckedWindow, eager: Sequence[Tensor], applied: Sequence[Tensor], notes: list[Note]
) -> tuple[list[list[float]], Rounding | None]:
    """The distance of the ``eager`` gradient from the float64 one per tensor (one float64 backward), as
    :func:`~.verdict.floors` takes it, and with the ``applied`` gradient the parts of a probe's discrepancy known
    without a probe (:class:`~.measured.Rounding`). For a model without float64 kernels (Triton, fused CUDA kernels),
    with a note, the float32 backward's own rounding instead (its spread at 3x the loss), and no known parts."""

    def reduce(i: int, exact: Tensor) -> tuple[float, float | None]:  # one float64 gradient alive at a time
        along = difference_dot(eager[i], exact, applied[i]) if applied else None
        return distances([eager[i]], [exact])[0], along

    try:
        found = setting.float64_reduced(reduce)
    except Exception as error:
        if own_error(error):  # a bug of gradwatch's own is not a model without float64 kernels
            raise
        text = f"no float64 gradient ({type(error).__name__}: {error}): the float32 noise floor is its backward's own"
        notes.append(Note(NoteCode.APPLIED_FLOOR, f"{text} rounding (the spread at {SPREAD_SCALE:g}x the loss)"))
        scaled = setting.eager(scale=SPREAD_SCALE)
        return [distances(list(eager), list(scaled))], None
    rounding = None
    if applied:
        rounding = Rounding([along for _, along in found if along is not None],
                            [difference_dot(a, e, a) for e, a in zip(eager, applied, strict=True)])  # fmt: skip
    return [[distance for distance, _ in found]], rounding


def floor_note(path_dtype: torch.dtype, floors: Sequence[float], norms: Sequence[float], multiple: float,
               measured: bool) -> Note:  # fmt: skip
    """The note that says which floor the probes were judged against."""
    dtype = str(path_dtype).removeprefix("torch.")
    relative = math.hypot(*floors) / max(math.hypot(*norms), 1e-300)
    rounding = storage_rounding(path_dtype)
    if not measured:
        return Note(
            NoteCode.APPLIED_FLOOR,
            f"noise floor of the {dtype} path not measured: every probe agreed within {multiple:g}x its storage "
            f"rounding ({rounding:.3g} of ‖g‖) plus its own noise, below any floor a measurement could give",
        )
    return Note(
        NoteCode.APPLIED_FLOOR,
        f"noise floor of the {dtype} path: {relative:.3g} of ‖g‖ (storage rounding alone {rounding:.3g}); a probe "
        f"fails beyond {multiple:g}x the floor plus its own noise",
    )


def tf32_floors(setting: CheckedWindow, eager: Sequence[Tensor], notes: list[Note]) -> list[list[float]] | None:
    """The measured distances :func:`~.verdict.floors` takes for a float32 path that runs in TF32 under training's
    settings, with a note; ``None`` (no backward) where no path of the device does."""
    paths = setting.session.numerics.reduced_on(autocast_path.device_type(setting.params))
    if not paths:
        return None
    again = setting.eager(ieee=False)
    notes.append(
        Note(
            NoteCode.APPLIED_FLOOR,
            f"training runs float32 {', '.join(paths)} in TF32 (torch.backends): the float32 path's noise floor is "
            "measured as training computes it, the gradient under those settings against IEEE float32's",
        )
    )
    return [distances(list(eager), again)]
