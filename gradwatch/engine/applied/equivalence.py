"""Accumulation equivalence: the gradient of a window of micro-batches against that of its samples taken as one batch.

An applied check verifies that the optimizer gets the derivative of the loss the loop computes. A loop can compute the
wrong loss, of which the gradient is the right derivative: transformers' gradient-accumulation bug (late 2024, PR#35207)
took each micro-batch's loss as the mean over its own tokens and averaged those means, so micro-batches with fewer
tokens weighed more, and the accumulated gradient was not the gradient of the window's tokens taken together (1.18x
along the update in a re-creation). The same window taken as one batch, under the loss's own reduction (a mean over its
samples or tokens, a sum), gives the gradient the accumulation is meant to reproduce.

:func:`compare_accumulation` concatenates the window's micro-batches (:func:`concatenate`: tensors along the batch
dimension, token tensors of different lengths padded, labels with ``-100`` and masks with 0) and computes both
gradients, eagerly and with the model in eval mode (dropout off, BatchNorm on its running statistics: otherwise the
micro-batches' own dropout masks and batch statistics would differ from one batch's, and that difference is no bug of
the loss). Along the applied direction it reports the **scale** ``(g_acc · ĝ_acc) / (g_one · ĝ_acc)`` and the
**cosine** of the two, and per tensor the same, and warns when they differ by more than the check's noise floor allows
(:data:`EQUIVALENCE_RTOL` at least). Micro-batches that are equal-size means agree (their mean of means is the mean),
as do sums combined by a sum; a summed loss averaged over the window is the one-batch gradient divided by the window's
size, which is said without a warning.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradwatch.engine.applied import gradients as recompute
from gradwatch.engine.applied.window import Combine, single_loss, window_loss
from gradwatch.engine.function.evaluation import LossFn
from gradwatch.engine.function.state import TrainingState
from gradwatch.engine.numerics.norms import dot, norms, total
from gradwatch.engine.results.notes import Note, NoteCode

PADDING = {"labels": -100, "attention_mask": 0, "input_ids": 0, "token_type_ids": 0, "decoder_input_ids": 0}
"""What a token tensor of a mapping batch is padded with (by key), so that padded positions count for nothing: labels
ignored by cross-entropy (``ignore_index=-100``), masked from attention."""

EQUIVALENCE_RTOL = 1e-4
"""The least relative difference warned of: both gradients are eager autograd of the same samples in the parameters'
dtype, and differ only by the order of their reductions when the loss is normalised over the window (~1e-7 in float32
on the equal-size windows of ``tests/engine/test_equivalence.py``); the bugs of this kind by 1e-2 and more."""

ROUNDING_MULTIPLE = 8.0
"""... and never less than this many units of the parameters' epsilon (6e-2 for bfloat16 parameters)."""


def _cat(tensors: list[Tensor], key: str | None) -> Tensor:
    if all(t.shape[1:] == tensors[0].shape[1:] for t in tensors):
        return torch.cat(tensors)
    if tensors[0].dim() < 2 or any(t.shape[1:-1] != tensors[0].shape[1:-1] for t in tensors):
        raise ValueError("micro-batch tensors differ in more than their last (sequence) dimension")
    if key not in PADDING or tensors[0].is_floating_point():
        raise ValueError(f"tensors of different lengths at {key or 'a position'} with no known padding value")
    length = max(t.shape[-1] for t in tensors)
    return torch.cat([F.pad(t, (0, length - t.shape[-1]), value=PADDING[key]) for t in tensors])


def _concatenate(parts: list[Any], key: str | None) -> Any:
    first = parts[0]
    if isinstance(first, Tensor):
        if not all(isinstance(p, Tensor) for p in parts) or first.dim() == 0:
            raise ValueError("a tensor without a batch dimension")
        return _cat(parts, key)
    if isinstance(first, Mapping):
        if any(not isinstance(p, Mapping) or p.keys() != first.keys() for p in parts):
            raise ValueError("micro-batches with different keys")
        joined = {k: _concatenate([p[k] for p in parts], str(k)) for k in first}
        return type(first)(joined) if type(first) is not dict else joined  # type: ignore[call-arg]
    if isinstance(first, (tuple, list)):
        if any(type(p) is not type(first) or len(p) != len(first) for p in parts):
            raise ValueError("micro-batches of different structure")
        items = [_concatenate([p[i] for p in parts], key) for i in range(len(first))]
        if hasattr(first, "_fields"):
            return type(first)(*items)
        return type(first)(items)
    if all(p == first for p in parts):
        return first
    raise ValueError(f"micro-batches that differ in a {type(first).__name__} that is not a tensor")


def concatenate(batches: Sequence[Any]) -> Any:
    """The micro-batches as one batch: tensors concatenated along their first (batch) dimension, token tensors of a
    mapping batch of different lengths padded at the end (:data:`PADDING`), equal non-tensor values kept. Raises
    ``ValueError`` naming why when they cannot be (tensors of different shapes without a padding rule, other
    structures)."""
    return _concatenate(list(batches), None)


@dataclass(frozen=True)
class Equivalence:
    """The accumulated gradient against the one-batch gradient (see the module doc).

    Attributes:
        scale: Along the accumulated gradient's direction, its derivative over the one-batch gradient's.
        cosine: The cosine of the two gradients.
        tensor_scales: The same scale per tensor (``nan`` where a tensor's gradient is within the check's noise floor
            of zero: a bias before a norm).
        tolerance: The relative difference beyond which they are said to differ (:data:`EQUIVALENCE_RTOL`).
        windows: How many micro-batches the window had.
    """

    scale: float
    cosine: float
    tensor_scales: tuple[float, ...]
    tolerance: float
    windows: int

    @property
    def averaged_sum(self) -> bool:
        """Whether the accumulated gradient is the one-batch gradient divided (or multiplied) by the window's size: a
        summed loss averaged over the window, a consistent choice."""
        if self.windows < 2 or not self._parallel:
            return False
        return any(abs(self.scale * factor - 1) <= self.tolerance for factor in (self.windows, 1 / self.windows))

    @property
    def _parallel(self) -> bool:
        return math.sqrt(max(0.0, 1 - self.cosine**2)) <= self.tolerance

    @property
    def differs(self) -> bool:
        """Whether the two differ beyond the tolerance (and not by the window's size alone)."""
        if self.averaged_sum:
            return False
        within = [s for s in self.tensor_scales if math.isfinite(s)]
        off = abs(self.scale - 1) > self.tolerance or not self._parallel
        return off or any(abs(s - 1) > self.tolerance for s in within)

    @property
    def worst(self) -> int | None:
        """The tensor whose scale is furthest from 1 (``None`` when none has one)."""
        found = [i for i, s in enumerate(self.tensor_scales) if math.isfinite(s)]
        return max(found, key=lambda i: abs(self.tensor_scales[i] - 1), default=None)


def _scale(acc: Sequence[Tensor], one: Sequence[Tensor]) -> float:
    along_one = total([dot(o, a) for o, a in zip(one, acc, strict=True)])
    return total([dot(a, a) for a in acc]) / along_one if along_one else math.inf


def _draws_randomness(model: nn.Module, batch: Any, loss_fn: LossFn, state: TrainingState) -> bool:
    """Whether the loss of ``batch`` changes with the random state (a VAE's noise): its window's micro-batches and the
    one batch would then draw different numbers, and their gradients differ by that. Two forwards, no gradient."""
    values = []
    for seed in (0, 1):
        state.before_evaluation()
        completed = False
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad(), recompute.exact_conditions():
                torch.manual_seed(seed)
                values.append(float(loss_fn(model, batch)))
            completed = True
        finally:
            state.after_evaluation(completed)
    return values[0] != values[1]


def compare_accumulation(
    model: nn.Module,
    batches: Sequence[Any],
    loss_fn: LossFn,
    rng_states: Sequence[dict[str, Any] | None],
    combine: Combine,
    params: Sequence[Tensor],
    names: Sequence[str],
    state: TrainingState,
    floors: Sequence[float],
    multiple: float,
    group: Any = None,
) -> tuple[Equivalence | None, list[Note]]:
    """Compare the window's accumulated gradient with its samples' gradient as one batch (see the module doc).

    Returns the comparison (``None`` when the batches cannot be concatenated or the loss refuses the result) and its
    notes: the figures (code ``"accumulation-equivalence"``), and a warning (``"accumulation-unequal"``) when they
    differ."""
    try:
        joined = concatenate(batches)
    except ValueError as error:
        return None, [Note(NoteCode.ACCUMULATION_EQUIVALENCE, f"accumulation not compared with one batch: {error}")]
    modes = [(module, module.training) for module in model.modules()]
    model.eval()  # dropout off, batch statistics fixed: both gradients under the same conditions
    try:
        one_loss = single_loss(loss_fn, rng_states[0], None)
        if _draws_randomness(model, joined, loss_fn, state):
            text = "accumulation not compared with one batch: the loss draws random numbers even in eval mode"
            return None, [Note(NoteCode.ACCUMULATION_EQUIVALENCE, text)]
        acc = recompute.eager_gradient(model, batches, window_loss(loss_fn, rng_states, combine, None), params,
                                       state, group)  # fmt: skip
        one = recompute.eager_gradient(model, joined, one_loss, params, state, group)
    except Exception as error:  # the loss refuses the concatenated batch: no comparison, the check stands
        text = f"accumulation not compared with one batch: the loss raised {type(error).__name__} ({error})"
        return None, [Note(NoteCode.ACCUMULATION_EQUIVALENCE, text)]
    finally:
        for module, training in modes:
            module.training = training
    acc_norms, one_norms = norms(acc, exact=True), norms(one, exact=True)
    size = math.hypot(*acc_norms)
    cosine = total([dot(a, o) for a, o in zip(acc, one, strict=True)]) / max(size * math.hypot(*one_norms), 1e-300)
    relative = [multiple * f / n if n > 0 else math.inf for f, n in zip(floors, acc_norms, strict=True)]
    tensor_scales = tuple(_scale([a], [o]) if r < 1 else math.nan for a, o, r in zip(acc, one, relative, strict=True))
    dtype = max((p.dtype for p in params), key=lambda d: torch.finfo(d).eps, default=torch.float32)
    tolerance = max(EQUIVALENCE_RTOL, ROUNDING_MULTIPLE * torch.finfo(dtype).eps)
    found = Equivalence(_scale(acc, one), cosine, tensor_scales, tolerance, len(batches))
    worst = found.worst
    figures = (
        f"the accumulated gradient of {len(batches)} micro-batches against the window's samples as one batch: scale "
        f"{found.scale:.6g} along the applied direction, cosine {found.cosine:.6g} (tolerance {tolerance:.2g})"
        + (f"; per tensor furthest from 1 at {names[worst]}: {tensor_scales[worst]:.6g}" if worst is not None else "")
    )
    notes = [Note(NoteCode.ACCUMULATION_EQUIVALENCE, figures)]
    if found.averaged_sum:
        notes.append(Note(NoteCode.ACCUMULATION_EQUIVALENCE, "the accumulated gradient is the one-batch gradient "
                          f"divided by the window's {len(batches)} micro-batches: a summed loss averaged over the "
                          "window, consistently"))  # fmt: skip
    if found.differs:
        notes.append(
            Note(
                NoteCode.ACCUMULATION_UNEQUAL,
                f"the accumulated gradient is {found.scale:.4g}x the gradient of the window's samples taken as one "
                f"batch (cosine {found.cosine:.6g}): the loss is normalised per micro-batch (a mean over each "
                "micro-batch's own samples or tokens, of unequal counts), not over the window; divide the summed "
                "loss by the window's count of samples or tokens instead (transformers' num_items_in_batch)",
            )
        )
    return found, notes
