"""The loss of an accumulation window, as one function, and what a loop records to check the gradient it applies.

The optimizer applies the gradient of the window's loss: every micro-batch, each forward with the random state it ran
with (dropout masks), combined as the loop combines them. :func:`window_loss` turns the user's ``loss_fn(model,
batch)`` into that one function of the parameters, ``loss(model, batches)``, which the engine's evaluator treats like
any loss of one batch. :class:`AppliedWindow` is what a loop keeps while a window runs: references to its
micro-batches, the random state before each, and a fingerprint of the gradients present when the window began (a loop
that forgot to zero them leaves them in the applied gradient).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.engine.function.evaluation import LossFn, as_scalar_loss
from gradwatch.engine.function.state import TrainingState, capture_rng, set_rng, unchanged
from gradwatch.engine.results.notes import Note, NoteCode

if TYPE_CHECKING:
    from gradwatch.engine.results.report import CheckReport

Combine = Literal["mean", "sum"] | Callable[[list[Tensor]], Tensor]
"""How a loop combines its micro-batch losses into the window's loss: ``"mean"`` (Lightning, and a loop that divides
each loss by the number of micro-batches), ``"sum"``, or ``combine(losses) -> Tensor``."""

COMBINES = ("mean", "sum")

PathContext = Callable[[], contextlib.AbstractContextManager[Any]]
"""A factory of the context the training's forward runs in, e.g. ``lambda: torch.autocast("cpu", torch.bfloat16)``."""


def combined(losses: list[Tensor], combine: Combine) -> Tensor:
    """The window's loss from its micro-batch losses (16-bit losses are combined in float32, as backward sees them)."""
    losses = [loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss for loss in losses]
    if callable(combine):
        return as_scalar_loss(combine(losses))
    total = sum(losses[1:], losses[0])
    return total / len(losses) if combine == "mean" else total


SLOW_GENERATORS = frozenset({"numpy", "python"})
"""The generators whose state costs the most to set (NumPy's ~60 µs, as much as a small model's forward; Python's
~4 µs): a window's loss stops setting them once its first evaluation showed that no micro-batch draws from them."""


def window_loss(
    loss_fn: LossFn,
    rng_states: Sequence[dict[str, Any] | None],
    combine: Combine,
    path: PathContext | None,
) -> LossFn:
    """``loss(model, batches)``: the window's combined loss, each micro-batch's forward run with its own random state
    (``None``: as the generators are) inside ``path()`` when given. A generator of :data:`SLOW_GENERATORS` that no
    forward advanced in the first evaluation is not set again (torch's, which a loss may read and put back itself,
    are set every time)."""
    context = path or contextlib.nullcontext
    undrawn: set[str] | None = None  # known after the first evaluation

    def loss(model: nn.Module, batches: Any) -> Tensor:
        nonlocal undrawn
        losses, first = [], undrawn is None
        left = set(SLOW_GENERATORS)
        for batch, state in zip(batches, rng_states, strict=True):
            if state is not None:
                set_rng(state, None if undrawn is None else [name for name in state if name not in undrawn])
            with context():
                losses.append(as_scalar_loss(loss_fn(model, batch)))
            if first and state is not None:
                left = {name for name in left if name in state and unchanged(name, state[name])}
        if first:
            undrawn = left
        return combined(losses, combine)

    return loss


def unrecorded_randomness(state: TrainingState, rng_states: Sequence[dict[str, Any] | None], notes: list[Note]) -> bool:
    """Whether the window's loss draws random numbers (dropout) that no recorded state replays, with a note then: the
    check would measure another function than training differentiated. Known after the check's first evaluation."""
    if not state.draws_random or any(s is not None for s in rng_states):
        return False
    text = (
        "no probe made: the loss draws random numbers (dropout) and no `rng_states` were given, so the check cannot "
        "draw the masks training drew; pass each micro-batch's random state from before its forward "
        "(`gradwatch.engine.function.state.capture_rng()`), or record the window with `AppliedWindow`, which does"
    )
    notes.append(Note(NoteCode.APPLIED_NOT_REPRODUCIBLE, text))
    return True


def single_loss(loss_fn: LossFn, state: dict[str, Any] | None, path: PathContext | None) -> LossFn:
    """The loss of one micro-batch of the window (its random state replayed), as ``loss(model, batch)``."""
    context = path or contextlib.nullcontext

    def loss(model: nn.Module, batch: Any) -> Tensor:
        if state is not None:
            set_rng(state)
        with context():
            return as_scalar_loss(loss_fn(model, batch))

    return loss


def _autocast_region() -> tuple[str, torch.dtype] | None:
    """The 16-bit autocast region enabled here, as ``(device type, dtype)``, if any (CPU and CUDA)."""
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            if dtype in (torch.float16, torch.bfloat16):
                return device, dtype
    return None


def autocast_context(device: str, dtype: torch.dtype) -> PathContext:
    return lambda: torch.autocast(device, dtype=dtype)


@dataclass(frozen=True)
class Checksums:
    """Per-tensor fingerprints of gradients: the float64 sum, sum of absolute values and sum of squares of each (one
    host transfer): enough to tell ranks that hold different gradients apart, and a leftover gradient from its copy."""

    sums: tuple[tuple[float, float, float], ...]

    @classmethod
    def of(cls, tensors: Sequence[Tensor | None]) -> Checksums:
        rows = []
        for tensor in tensors:
            if tensor is None:
                rows.append(torch.zeros(3, dtype=torch.float64))
                continue
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a shard's own rows (FSDP2)
            local = torch.view_as_real(local.resolve_conj()) if local.is_complex() else local
            flat = local.detach().reshape(-1).double()
            rows.append(torch.stack([flat.sum(), flat.abs().sum(), flat.square().sum()]).cpu())
        values = torch.stack(rows).tolist() if rows else []
        return cls(tuple((a, b, c) for a, b, c in values))

    @property
    def empty(self) -> bool:
        """Whether every fingerprinted tensor was zero (or absent)."""
        return all(row[1] == 0.0 for row in self.sums)


class AppliedWindow:
    """What a loop records while an accumulation window runs, for :func:`check_applied_gradient` at its optimizer step.

    Call :meth:`record` with each micro-batch just before its forward (it keeps a reference to the batch, not a copy,
    and the random state the forward is about to draw from), then :meth:`check` just before ``optimizer.step()`` (after
    ``loss.backward()`` of the last micro-batch and any unscaling, before clipping), then :meth:`clear`.

    Args:
        model: The module whose gradients the optimizer applies; ``None`` when not known yet (a watch's first window):
            the gradients present when the window begins are then not fingerprinted, and :meth:`check` needs none.

    Example::

        window = AppliedWindow(model)
        for i, batch in enumerate(loader):
            window.record(batch)
            (loss_fn(model, batch) / accumulate).backward()
            if (i + 1) % accumulate == 0:
                if step % 1000 == 0:
                    report = window.check(loss_fn)
                optimizer.step()
                optimizer.zero_grad()
                window.clear()
    """

    def __init__(self, model: nn.Module | None) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module; got {type(model).__name__}")
        self.model = model
        self.batches: list[Any] = []
        self.rng_states: list[dict[str, Any]] = []
        self.start: Checksums | None = None
        self.last_fault: tuple[int, str | None] | None = None  # the last check's step and fault (kept by clear())
        self.autocast: tuple[str, torch.dtype] | None = None  # the autocast region record() was called in, if any

    def record(self, batch: Any) -> None:
        """Keep ``batch`` (a reference) and the random state its forward will draw from; on the window's first
        micro-batch, the fingerprint of the gradients already there.

        Args:
            batch: The micro-batch about to be run forward (not copied: do not change it in place before the step).
        """
        if not self.batches and self.model is not None:
            self.start = Checksums.of([p.grad for p in self.model.parameters() if p.requires_grad])
        self.batches.append(batch)
        self.rng_states.append(capture_rng())
        self.autocast = self.autocast or _autocast_region()

    def clear(self) -> None:
        """Forget the window (after the optimizer step)."""
        self.batches, self.rng_states, self.start, self.autocast = [], [], None, None

    def check(self, loss_fn: LossFn, model: nn.Module | None = None, **options: Any) -> CheckReport:
        """:func:`~gradwatch.check_applied_gradient` of the model's ``.grad`` over the recorded window.

        A window reused across steps (:meth:`clear` after each) calls a ``"transient"`` fault its previous check found
        too ``"modified"``. Without a ``path``, a window recorded inside an autocast region (``record`` called in the
        ``with torch.autocast(...)`` block of the forward) is checked on that autocast path, with a note.

        Args:
            loss_fn: ``loss_fn(model, batch) -> scalar Tensor``, the loss of one micro-batch as the loop computes it.
            model: The module whose ``.grad`` is checked; the window's own by default.
            **options: Passed on to :func:`~gradwatch.check_applied_gradient`, keywords all (``combine``, ``path``,
                ``step``, the probe options or ``settings``, ...).
        """
        from gradwatch.engine.applied.check import check_applied_gradient  # it imports this module

        if not self.batches:
            raise ValueError(
                "AppliedWindow.check: no micro-batch was recorded (call record(batch) before each forward)"
            )
        model = model if model is not None else self.model
        if model is None:
            raise ValueError("AppliedWindow.check: `model` must be given when the window was made without one")
        from gradwatch.engine.applied.attribution import recurring

        region = self.autocast if options.get("path") is None else None
        if region is not None:
            options["path"] = autocast_context(*region)
        report = check_applied_gradient(
            model, self.batches, loss_fn, rng_states=self.rng_states, start=self.start, **options
        )
        if region is not None:
            device, dtype = region[0], str(region[1]).removeprefix("torch.")
            text = f"the window was recorded inside {device} autocast to {dtype}: the path is judged as that autocast"
            report.notes.append(Note(NoteCode.APPLIED_PATH_INFERRED, text))
        # a window reused from step to step (clear() after each) tells a change made at every step from a one-off
        report = recurring(report, self.last_fault)
        self.last_fault = (report.step, report.fault)
        return report


def applied_gradients(
    trainable: list[tuple[str, nn.Parameter]], given: Mapping[str, Tensor] | Sequence[Tensor] | None
) -> list[Tensor | None]:
    """Each trainable parameter's gradient to check: its ``.grad``, or what ``given`` holds for it (by name or in
    order)."""
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


def _unlike_rank_0(mine: Any, group: Any) -> list[int]:
    """The ranks whose ``mine`` differs from rank 0's (one gather, every rank)."""
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return [rank for rank, found in enumerate(every) if rank and found != every[0]]


def disagreeing_ranks(applied: list[Tensor], group: Any) -> list[int]:
    """The ranks whose gradient checksums differ from rank 0's."""
    return _unlike_rank_0(Checksums.of(applied), group)


def ranks_with_other_parameters(named: Sequence[tuple[str, Tensor]], group: Any) -> list[int]:
    """The ranks whose checked parameters (names and shapes) differ from rank 0's: a model split across the ranks by
    hand, not replicas as under DDP. Values are not compared: replicas whose values drifted apart are still replicas."""
    return _unlike_rank_0(tuple((name, tuple(p.shape)) for name, p in named), group)
