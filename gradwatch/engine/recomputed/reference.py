"""The reference of a check: the loss and autograd's gradient at the checked point, and the tests that finite
differences there can be compared with them.

The reference is computed on the first samples of the batch (:func:`reference_on_a_slice`): every later evaluation of
the check then costs a forward pass on that slice, and the function checked is exactly the loss of the slice. Before
any probe, the loss is evaluated again without autograd, in the probes' precision (:func:`reproduced_center`): if it
is not the reference loss, the evaluations compute another function (randomness that cannot be replayed, kernels that
differ under ``torch.no_grad()``) and no probe could be trusted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gradwatch.engine.distributed.collective import active as sharding_active
from gradwatch.engine.distributed.collective import global_index
from gradwatch.engine.function.batch import leading_slice
from gradwatch.engine.function.evaluation import LossEvaluator, LossFn, Reference
from gradwatch.engine.numerics.steps import center_tolerance
from gradwatch.engine.recomputed.faithfulness import UnfaithfulFloat64Error
from gradwatch.engine.results.kinds import ProbeKind, Reason, Verdict
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import Probe
from gradwatch.errors import passes_fallbacks

if TYPE_CHECKING:
    from gradwatch.engine.session import CheckSession

BATCH_NORM_SAMPLES = 4
"""The slice probes fall back to when the loss refuses a smaller one (BatchNorm in training mode refuses one sample).
Not two: BatchNorm over two samples maps each feature to about ±1, a function so sharply curved (where the two are
close) that float32 autograd's round-off on a bias before it rivals the model's gradient."""


def reference_on_a_slice(
    session: CheckSession, batch: Any, loss_fn: LossFn, *, with_inputs: bool, notes: list[Note]
) -> tuple[LossEvaluator, Reference, Any]:
    """The evaluator and reference gradient of the session's parameters (and inputs, ``with_inputs``) on the first
    ``probe_batch_size`` samples, else the first :data:`BATCH_NORM_SAMPLES`, else the whole batch: the first the loss
    accepts, a note saying why. BatchNorm refuses one sample (train-mode statistics need two values per channel); some
    losses refuse any slice (a batch-size constant, a full-size tensor that was not cut)."""
    model, params, state, settings = session.model, session.params, session.state, session.settings
    assert state is not None, "a check's measurements run inside session.measuring()"
    probe_batch_size, float64_reductions = settings.probe_batch_size, settings.float64_reductions
    sizes = [] if probe_batch_size is None else [probe_batch_size]
    if probe_batch_size is not None and probe_batch_size < BATCH_NORM_SAMPLES:
        sizes.append(BATCH_NORM_SAMPLES)
    refused = False
    for size in sizes:
        probe_batch = leading_slice(batch, size)
        if probe_batch is batch:
            break
        held = session.held_detaches()
        evaluator = LossEvaluator(
            model, probe_batch, loss_fn, params, state, float64_reductions=float64_reductions, held=held
        )
        try:
            return evaluator, evaluator.reference(with_inputs=with_inputs), probe_batch
        except Exception as error:
            if passes_fallbacks(error):
                raise
            refused = True
            notes.append(Note(NoteCode.SLICE_REFUSED, (
                f"the loss raised {type(error).__name__} on the first {size} sample(s) ({error})")))  # fmt: skip
    if refused:
        notes.append(Note(NoteCode.WHOLE_BATCH, "probes use the whole batch"))
    evaluator = LossEvaluator(
        model, batch, loss_fn, params, state, float64_reductions=float64_reductions, held=session.held_detaches()
    )
    return evaluator, evaluator.reference(with_inputs=with_inputs), batch


def without_edited(
    evaluator: LossEvaluator, params: list[tuple[str, Tensor]], reference: Reference, edited: set[int]
) -> tuple[list[tuple[str, Tensor]], Reference]:
    """The parameters to probe and their reference gradients, without those the loss changes itself (``edited``, by
    ``id``: changed in place, rebound, ``requires_grad`` toggled; :mod:`gradwatch.engine.function.guard`): the loss at a
    displaced parameter it then changes is a function autograd does not differentiate (a clamp applied under
    ``torch.no_grad()``), and probing it would raise false alarms. Every evaluation starts from the parameter's own
    value, so the other parameters are probed as usual."""
    keep = [i for i, (_, p) in enumerate(params) if id(p) not in edited]
    if len(keep) == len(params):
        return params, reference
    names = [name for i, (name, _) in enumerate(params) if i not in keep]
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    evaluator.notes.append(Note(NoteCode.EDITED_NOT_PROBED, (
        f"not probed: {shown}, which the loss changes itself (in place, rebound or requires_grad toggled), so the "
        "function of them it evaluates is not the one autograd differentiates; gradwatch put them back after every "
        "evaluation")))  # fmt: skip
    params = [params[i] for i in keep]
    evaluator.params = params
    return params, dataclasses.replace(reference, param_grads=[reference.param_grads[i] for i in keep])


def reproduced_center(
    evaluator: LossEvaluator,
    reference: Reference,
    center: float,
    native_dtype: torch.dtype,
    compute_dtype: torch.dtype,
) -> tuple[float, float] | None:
    """The loss at the unperturbed point in the probes' precision (``center``, if already evaluated, else NaN) and the
    jitter between two evaluations of it; ``None``, with a note, if it is not the reference loss; an
    :class:`UnfaithfulFloat64Error` (the check then probes natively) where float64 probes of a lower-precision model do
    not reproduce it. A loss that differs under ``torch.no_grad()`` (kernels or draws that depend on grad mode) is
    evaluated with autograd recording from then on, with a note."""
    expected = reference.loss
    tolerance = center_tolerance(expected, native_dtype, compute_dtype)
    if math.isnan(center):
        center = evaluator.loss()
    if abs(center - expected) > tolerance:
        native = evaluator.native_loss()
        if abs(native - expected) > tolerance:
            evaluator.use_grad_mode()
            native = evaluator.native_loss()
            if abs(native - expected) > tolerance:
                if compute_dtype == torch.float64 != native_dtype:
                    raise UnfaithfulFloat64Error(f"its loss is {center:.9g} there, {expected:.9g} in training")
                evaluator.notes.append(Note(NoteCode.NOT_REPRODUCIBLE, (
                    f"no probe made: the loss is not reproducible ({expected:.9g} when differentiated, "
                    f"{native:.9g} when evaluated again with the same random state); it draws randomness gradwatch "
                    "cannot replay")))  # fmt: skip
                return None
            evaluator.notes.append(Note(NoteCode.AUTOGRAD_RECORDING, (
                "evaluations run with autograd recording: the loss differs under torch.no_grad()")))  # fmt: skip
        center = evaluator.loss()
    # on devices with non-deterministic kernels, how much a second evaluation of the centre differs from the first
    tensors = [p for _, p in evaluator.params] + list(evaluator.inputs.values())
    if any(t.device.type != "cpu" for t in tensors) and not torch.are_deterministic_algorithms_enabled():
        return center, abs(evaluator.loss() - center)
    return center, 0.0


def nonfinite_probes(
    reference: Reference, params: Sequence[tuple[str, Tensor]], grad_norms: Sequence[float]
) -> list[Probe]:
    """A failing probe for a non-finite loss, or for each parameter whose gradient has a non-finite entry (only a
    gradient whose norm is not finite is searched for one)."""
    if not math.isfinite(reference.loss):
        return [_nonfinite_probe(ProbeKind.LOSS, "loss", None, reference.loss)]
    probes = []
    for (name, _), grad, size in zip(params, reference.param_grads, grad_norms, strict=True):
        if grad is None or math.isfinite(size):
            continue
        positions = (~torch.isfinite(grad)).nonzero()
        if len(positions):
            index = tuple(int(i) for i in positions[0])
            probes.append(_nonfinite_probe(ProbeKind.PARAM, name, global_index(grad, index), grad[index].item()))
        elif sharding_active():  # another rank's shard holds it: every rank must fail alike (and probe no further)
            probes.append(_nonfinite_probe(ProbeKind.PARAM, name, None, size))
    return probes


def _nonfinite_probe(kind: ProbeKind, target: str, index: tuple[int, ...] | None, value: float) -> Probe:
    return Probe(kind, target, index, value, math.nan, math.inf, verdict=Verdict.FAIL, noise=math.nan, step=0.0,
                 reason=Reason.NONFINITE)  # fmt: skip
