"""Accumulation equivalence: the gradient of a window of micro-batches against that of its samples taken as one batch.

An applied check verifies that the optimizer gets the derivative of the loss the loop computes. A loop can compute the
wrong loss: transformers' gradient-accumulation bug (late 2024, PR#35207) averaged each micro-batch's mean over its own
tokens, so micro-batches with fewer tokens weighed more (1.18x along the update in a re-creation). The same window
taken as one batch, under the loss's own reduction, gives the gradient the accumulation is meant to reproduce.

:func:`compare_accumulation` joins the window's micro-batches into one (by default :func:`concatenate`, else the
loop's :data:`Join`) and computes both gradients eagerly in eval mode (dropout off, BatchNorm on its running
statistics: the micro-batches' own masks and statistics are no bug of the loss). Along the applied direction it
reports the **scale** ``(g_acc · ĝ_acc) / (g_one · ĝ_acc)`` and the **cosine** of the two, and per tensor the same,
and warns when they differ by more than their rounding allows: measured as an applied check measures its floor, the
spread ``‖g_one,T − g_3,T / 3‖`` between the one-batch gradient of the loss and of three times the loss (float32:
~1e-7 of ``‖g‖``; 16 bits: ~1e-3), at least the storage rounding (:func:`tolerances`). Equal-size means agree, as do
sums combined by a sum; a summed loss averaged over the window (the one-batch gradient divided by the window's size)
is said without a warning, unless the loop says its micro-batch losses are already normalised over the whole window
(``window_normalised``, as transformers' ``num_items_in_batch``), when that division is a second normalisation (a
DAPO-style loss divided again by 4 micro-batches). Micro-batch means summed over the window (a loss never divided by
the accumulation steps, TRL's "4x") are always warned of.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradwatch.engine.applied import gradients as recompute
from gradwatch.engine.applied.path import CheckedWindow
from gradwatch.engine.applied.verdict import SPREAD_SCALE, distances, floor_multiple
from gradwatch.engine.applied.window import single_loss
from gradwatch.engine.function.evaluation import LossFn
from gradwatch.engine.function.state import TrainingState
from gradwatch.engine.numerics.norms import dot, norms, total
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.errors import own_error

PADDING = {
    "labels": -100,
    "attention_mask": 0,
    "completion_mask": 0,
    "input_ids": 0,
    "token_type_ids": 0,
    "decoder_input_ids": 0,
}
"""What a token tensor of a mapping batch is padded with (by key), so that padded positions count for nothing: labels
ignored by cross-entropy (``ignore_index=-100``), masked from attention."""

ROUNDING_MULTIPLE = 8.0
"""The least relative difference warned of, in units of the computing dtype's epsilon (1e-6 in float32, 6e-2 in
bfloat16): a measured spread of exactly zero (a gradient every kernel rounds alike) still leaves the storage rounding of
two gradients reduced in different orders."""

Join = Callable[[list[Any]], Any]
"""``join(items) -> item``: the window's micro-batch items (as ``loss_fn`` takes them) as one item of all their
samples, or ``ValueError`` saying why not; :func:`concatenate` by default."""


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
    """The micro-batches as one batch: tensors concatenated along their batch dimension, token tensors of a mapping
    batch of different lengths padded at the end (:data:`PADDING`), equal non-tensor values kept; ``ValueError``
    saying why they cannot be."""
    return _concatenate(list(batches), None)


@dataclass(frozen=True)
class Equivalence:
    """The accumulated gradient against the one-batch gradient (see the module doc).

    Attributes:
        scale: Along the accumulated gradient's direction, its derivative over the one-batch gradient's.
        cosine: The cosine of the two gradients.
        tensor_scales: The same scale per tensor (``nan`` where a tensor's gradient is within its rounding of zero).
        tolerance: The relative difference of the whole gradients beyond which they are said to differ
            (:func:`tolerances`).
        windows: How many micro-batches the window had.
        tensor_tolerances: The same per tensor (empty: ``tolerance`` for every tensor).
        sine: The sine of the angle between the two, as the share of the accumulated gradient's norm off the one-batch
            gradient's direction (``nan``: from ``cosine``, which resolves a sine only to ~1e-4).
        backward: The backward passes the comparison made (2, or 3 when the rounding was measured).
    """

    scale: float
    cosine: float
    tensor_scales: tuple[float, ...]
    tolerance: float
    windows: int
    _: dataclasses.KW_ONLY
    tensor_tolerances: tuple[float, ...] = ()
    sine: float = math.nan
    backward: int = 3
    window_normalised: bool = False

    @property
    def averaged_sum(self) -> bool:
        """Whether the accumulated gradient is a summed loss averaged over the window's size, consistently (unless the
        loss was normalised over the window already)."""
        return self.divided_by_window and not self.window_normalised

    @property
    def divided_by_window(self) -> bool:
        """Whether the accumulated gradient is the one-batch gradient divided by the window's size."""
        return self._window_factor(1 / self.windows)

    @property
    def multiplied_by_window(self) -> bool:
        """Whether the accumulated gradient is the one-batch gradient times the window's size (means summed)."""
        return self._window_factor(float(self.windows))

    def _window_factor(self, factor: float) -> bool:
        if self.windows < 2 or not self._parallel:
            return False
        return abs(self.scale / factor - 1) <= self.tolerance

    @property
    def _parallel(self) -> bool:
        sine = self.sine if math.isfinite(self.sine) else math.sqrt(max(0.0, 1 - self.cosine**2))
        return sine <= self.tolerance

    @property
    def differs(self) -> bool:
        """Whether the two differ beyond the tolerance (and not by the window's size alone)."""
        if self.averaged_sum:
            return False
        off = abs(self.scale - 1) > self.tolerance or not self._parallel
        return off or any(abs(self.tensor_scales[i] - 1) > self._tolerances[i] for i in self._finite)

    @property
    def worst(self) -> int | None:
        """The tensor whose scale is furthest from 1 in units of its tolerance (``None`` when none has one)."""
        return max(self._finite, key=lambda i: abs(self.tensor_scales[i] - 1) / self._tolerances[i], default=None)

    @property
    def _finite(self) -> list[int]:
        return [i for i, s in enumerate(self.tensor_scales) if math.isfinite(s)]

    @property
    def _tolerances(self) -> tuple[float, ...]:
        return self.tensor_tolerances or (self.tolerance,) * len(self.tensor_scales)


def _scale(acc: Sequence[Tensor], one: Sequence[Tensor]) -> float:
    along_one = total([dot(o, a) for o, a in zip(one, acc, strict=True)])
    return total([dot(a, a) for a in acc]) / along_one if along_one else math.inf


def _sine(acc: Sequence[Tensor], one: Sequence[Tensor]) -> float:
    """``‖acc − λ·one‖ / ‖acc‖`` with ``λ·one`` the projection of ``acc`` on ``one``, in float64."""
    along = total([dot(a, o) for a, o in zip(acc, one, strict=True)])
    squares = total([dot(o, o) for o in one])
    ratio = along / squares if squares > 0 else 0.0
    off = [norms([a.double() - ratio * o.double()], exact=True)[0] for a, o in zip(acc, one, strict=True)]
    return math.hypot(*off) / max(math.hypot(*norms(acc, exact=True)), 1e-300)


def _compared(acc: Sequence[Tensor], one: Sequence[Tensor], spread: Sequence[float], dtype: torch.dtype, windows: int,
              backward: int) -> Equivalence:  # fmt: skip
    tolerance, per_tensor = tolerances(one, spread, dtype)
    size = math.hypot(*norms(acc, exact=True))
    cosine = total([dot(a, o) for a, o in zip(acc, one, strict=True)]) / max(
        size * math.hypot(*norms(one, exact=True)), 1e-300
    )
    tensor_scales = tuple(_scale([a], [o]) if t < 1 else math.nan for a, o, t in zip(acc, one, per_tensor, strict=True))
    return Equivalence(_scale(acc, one), cosine, tensor_scales, tolerance, windows, tensor_tolerances=tuple(per_tensor),
                       sine=_sine(acc, one), backward=backward)  # fmt: skip


def _draws_randomness(model: nn.Module, batch: Any, loss_fn: LossFn, state: TrainingState) -> bool:
    """Whether the loss of ``batch`` changes with the random state (a VAE's noise), which the window and the one batch
    would draw otherwise. Two forwards, no gradient."""
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


def tolerances(one: Sequence[Tensor], spread: Sequence[float], dtype: torch.dtype) -> tuple[float, list[float]]:
    """The relative differences of the two gradients their rounding allows, of the whole and per tensor: each is off by
    about the measured ``spread``, so :func:`~.verdict.floor_multiple` times twice that, relative to the one-batch
    gradient's norm, and at least :data:`ROUNDING_MULTIPLE` units of ``dtype``'s epsilon."""
    least = ROUNDING_MULTIPLE * torch.finfo(dtype).eps
    bound = 2 * floor_multiple(dtype)
    sizes = norms(list(one), exact=True)
    whole = max(least, bound * math.hypot(*spread) / max(math.hypot(*sizes), 1e-300))
    return whole, [max(least, bound * d / n) if n > 0 else math.inf for d, n in zip(spread, sizes, strict=True)]


def compare_accumulation(setting: CheckedWindow, names: Sequence[str], *, join: Join | None = None,
                         window_normalised: bool | Callable[[], bool] = False,
                         ) -> tuple[Equivalence | None, list[Note]]:  # fmt: skip
    """Compare the window's accumulated gradient with its samples' gradient as one batch (see the module doc): two
    eager backward passes, and a third (the one batch at three times the loss) measuring the tolerance only when they
    differ by more than the least one. ``window_normalised`` (a function asked only when the accumulated gradient is
    the one-batch one divided by the window's size): that division is a second normalisation, warned of.

    Returns the comparison (``None`` when the batches cannot be joined or the loss refuses them) and its notes: the
    figures (``"accumulation-equivalence"``), and a warning (``"accumulation-unequal"``) when they differ."""
    model, batches, params, state = setting.model, setting.batches, setting.params, setting.state
    loss_fn = setting.loss_fn
    try:
        joined = (join or concatenate)(list(batches))
    except ValueError as error:
        return None, [Note(NoteCode.ACCUMULATION_EQUIVALENCE, f"accumulation not compared with one batch: {error}")]
    dtype = max((p.dtype for p in params), key=lambda d: torch.finfo(d).eps, default=torch.float32)
    modes = [(module, module.training) for module in model.modules()]
    model.eval()  # dropout off, batch statistics fixed: both gradients under the same conditions
    try:
        one_loss = single_loss(loss_fn, setting.rng_states[0], None)
        if _draws_randomness(model, joined, loss_fn, state):
            text = "accumulation not compared with one batch: the loss draws random numbers even in eval mode"
            return None, [Note(NoteCode.ACCUMULATION_EQUIVALENCE, text)]
        acc = setting.eager()
        one = recompute.eager_gradient(model, joined, one_loss, params, state, group=setting.group)
        found = _compared(acc, one, [0.0] * len(one), dtype, len(batches), 2)
        if found.differs:  # beyond the least tolerance: measure the rounding (monotone: a larger one only agrees more)
            again = recompute.eager_gradient(model, joined, one_loss, params, state, group=setting.group,
                                             scale=SPREAD_SCALE)  # fmt: skip
            spread = distances(one, again)
            del again
            found = _compared(acc, one, spread, dtype, len(batches), 3)
    except Exception as error:  # the loss refuses the joined batch: no comparison, the check stands
        if own_error(error):
            raise
        text = f"accumulation not compared with one batch: the loss raised {type(error).__name__} ({error})"
        return None, [Note(NoteCode.ACCUMULATION_EQUIVALENCE, text)]
    finally:
        for module, training in modes:
            module.training = training
    if found.divided_by_window and (window_normalised() if callable(window_normalised) else window_normalised):
        found = dataclasses.replace(found, window_normalised=True)
    worst = found.worst
    figures = (
        f"the accumulated gradient of {len(batches)} micro-batches against the window's samples as one batch: scale "
        f"{found.scale:.6g} along the applied direction, cosine {found.cosine:.6g} (tolerance {found.tolerance:.2g}, "
        + ("their measured rounding)" if found.backward > 2 else f"{ROUNDING_MULTIPLE:g} units of {dtype}'s epsilon)")
    )
    if worst is not None:
        figures += (f"; per tensor furthest from 1 at {names[worst]}: {found.tensor_scales[worst]:.6g} (tolerance "
                    f"{found.tensor_tolerances[worst]:.2g})")  # fmt: skip
    notes = [Note(NoteCode.ACCUMULATION_EQUIVALENCE, figures)]
    if found.averaged_sum:
        notes.append(Note(NoteCode.ACCUMULATION_EQUIVALENCE, "the accumulated gradient is the one-batch gradient "
                          f"divided by the window's {len(batches)} micro-batches: a summed loss averaged over the "
                          "window, consistently"))  # fmt: skip
    if found.differs:
        notes.append(Note(NoteCode.ACCUMULATION_UNEQUAL, _unequal(found)))
    return found, notes


def _unequal(found: Equivalence) -> str:
    said = (
        f"the accumulated gradient is {found.scale:.4g}x the gradient of the window's samples taken as one batch "
        f"(cosine {found.cosine:.6g}): "
    )
    if found.divided_by_window:
        return said + (
            f"the loss is normalised twice: each micro-batch's loss is already divided by the window's count of "
            f"samples or tokens, and divided again by the window's {found.windows} micro-batches, so every update is "
            f"{found.windows} times too small; divide by one of the two only"
        )
    if found.multiplied_by_window:
        return said + (
            f"the window's {found.windows} micro-batch losses are summed where each is a mean over its own "
            f"micro-batch, so every update is {found.windows} times too large; divide each by the number of "
            "micro-batches, or normalise the summed loss by the window's count of samples or tokens"
        )
    return said + (
        "the loss is normalised per micro-batch (a mean over each micro-batch's own samples or tokens, of unequal "
        "counts), not over the window; divide the summed loss by the window's count of samples or tokens instead "
        "(transformers' num_items_in_batch)"
    )
