"""Values the loss detaches, held at the reference's during a check: the function autograd differentiates.

``x.detach()`` makes autograd differentiate the loss with ``x`` fixed at its value at the point, while the loss as
written, evaluated elsewhere, lets ``x`` move with the parameters. Most detaches keep the two derivatives the same (a
target network, a value read for a metric); some make them differ on purpose, and a finite difference of the loss as
written measures neither:

* a **surrogate objective**: GRPO's policy loss with one optimisation pass per generation (TRL's ``GRPOTrainer`` at
  its defaults) is built on ``exp(logp - logp.detach())``, 1 wherever it is evaluated: flat in the parameters, while
  its gradient is the policy gradient;
* **DoRA** (PEFT's ``use_dora=True``) divides by the norm of the adapted weight, detached (the DoRA paper, 4.3).

:class:`HeldDetaches` makes a check evaluate the function autograd differentiated: the reference pass records the
value of each ``detach`` within its scope, in call order; in every other evaluation the same call returns the recorded
value (in the evaluation's dtype), constant while the parameters move, as for autograd. A detach of a tensor that did
not require grad in the reference pass depends on no parameter and is not replaced.

The scope is explicit, never the whole loss by default: an accidental ``detach`` that gives a parameter exactly no
gradient must still fail a check, and held it would read as a flat loss agreeing with a zero gradient.

* ``outside``: the detaches the loss makes outside the forward of every module of the model, called through the model
  or directly (GRPO's objective: :attr:`~gradwatch.engine.settings.ProbeSettings.hold_detached`);
* ``inside``: the detaches made inside the forward of given modules (DoRA's, :mod:`.surrogates`).

A loss that detaches tensors in another order, shape or kind than in the reference pass cannot be replayed: the
evaluation's value is then NaN (the probe ends ``inconclusive``, reason ``"nonfinite"``, never ``"fail"``), with a
note. In an activation checkpoint's recomputation a detach inside ``inside`` modules returns what the forward returned
for the same argument. The check's own detaches during the loss (the culprit search's hooks) are never held.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.nn.modules.module as torch_module
from torch import Tensor, nn

from gradwatch.engine.function.modes import OperationMode
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.errors import HeldValuesError

_DETACHES = {Tensor.detach, torch.detach}


@dataclass(frozen=True)
class _Detached:
    """One ``detach`` of the reference pass: the value it returned (``None``: not held) and what it detached."""

    value: Tensor | None
    shape: torch.Size
    dtype: torch.dtype


class _Depth:
    """How many forwards of a set of modules are running."""

    def __init__(self) -> None:
        self.count = 0

    def enter(self, *_: Any) -> None:
        self.count += 1

    def leave(self, *_: Any) -> None:
        self.count -= 1


@contextlib.contextmanager
def _counted_within(model: nn.Module | None, depth: _Depth) -> Iterator[None]:
    """Count in ``depth`` the running forwards of every module of ``model`` for the duration: global module hooks, so
    that a loss that calls a submodule directly (``module.net(x)``) is inside the model there too."""
    depth.count = 0
    if model is None:
        yield
        return
    inside = {id(module) for module in model.modules()}

    def enter(module: nn.Module, *_: Any) -> None:
        if id(module) in inside:
            depth.count += 1

    def leave(module: nn.Module, *_: Any) -> None:
        if id(module) in inside:
            depth.count -= 1

    handles = [
        torch_module.register_module_forward_pre_hook(enter),
        torch_module.register_module_forward_hook(leave, always_call=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _counted(modules: Sequence[nn.Module], depth: _Depth) -> Iterator[None]:
    """Count the running forwards of ``modules`` in ``depth`` for the duration."""
    depth.count = 0
    handles = []
    try:
        for module in modules:
            handles.append(module.register_forward_pre_hook(depth.enter, prepend=True))
            handles.append(module.register_forward_hook(depth.leave, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


class HeldDetaches:
    """The values the loss detaches outside the forward of every module of the model ``outside`` (the loss's own) and
    inside the forward of the modules ``inside``, recorded in a check's reference pass and held in every other
    evaluation (see the module doc)."""

    def __init__(self, outside: nn.Module | None = None, inside: Sequence[nn.Module] = ()) -> None:
        self.outside = outside
        self.inside = tuple(inside)
        self.recorded: list[_Detached] | None = None
        """The detaches of the reference pass, in call order; ``None`` until a reference pass completed."""
        self.mismatch: str | None = None
        """Why the last evaluation could not be replayed, or ``None``."""
        self.notes: list[Note] = []
        self._pending: list[_Detached] = []
        self._position = 0
        self._recording = False
        self._recomputing = False
        # (argument, value held or None where none was): for recomputations
        self._forward_pairs: list[tuple[Tensor, Tensor | None]] = []
        self._model_depth, self._inside_depth = _Depth(), _Depth()

    @property
    def active(self) -> bool:
        return self.outside is not None or bool(self.inside)

    @property
    def held(self) -> int:
        """How many values the reference pass recorded to hold."""
        return sum(entry.value is not None for entry in self.recorded or ())

    def evaluating(self) -> contextlib.AbstractContextManager[None]:
        """Around one call of the loss: record its detaches until a reference pass completed, else replay them; then
        :meth:`differentiated` after a differentiated call that completed, :meth:`finish` after any other. Where no
        detach is held (most losses), a context that does nothing, entered at every evaluation at no cost."""
        return self._evaluating() if self.active else contextlib.nullcontext()

    @contextlib.contextmanager
    def _evaluating(self) -> Iterator[None]:
        self._recording = self.recorded is None
        self._pending, self._position, self.mismatch = [], 0, None
        self._forward_pairs, self._recomputing = [], False
        with (
            _counted_within(self.outside, self._model_depth),
            _counted(self.inside, self._inside_depth),
            _HeldMode(self),
        ):
            yield

    def differentiating(self) -> contextlib.AbstractContextManager[None]:
        """Around the backward of a replayed evaluation: an activation checkpoint's recomputation of a detach inside
        the ``inside`` modules returns what the forward returned for the same argument."""
        if not self.active or self._recording or not self._forward_pairs:
            return contextlib.nullcontext()
        return self._differentiating()

    @contextlib.contextmanager
    def _differentiating(self) -> Iterator[None]:
        self._recomputing = True
        try:
            with _counted(self.inside, self._inside_depth), _HeldMode(self):
                yield
        finally:
            self._recomputing = False

    def differentiated(self) -> None:
        """After a differentiated evaluation that completed: the first keeps what it recorded (with a note when it
        holds anything); a later one must have replayed every value, else :class:`HeldValuesError`."""
        if not self._recording:
            if self.finish() is not None:
                raise HeldValuesError(f"the values the loss detaches could not be held: {self.mismatch}")
            return
        self.recorded, self._recording = self._pending, False
        if self.held:
            where = []
            if self.outside is not None:
                where.append("in the loss outside the model's forward")
            if self.inside:
                where.append(f"inside {len(self.inside)} module(s) that detach by design")
            self.notes.append(
                Note(
                    NoteCode.DETACHED_HELD,
                    f"{self.held} value(s) the loss detaches ({' and '.join(where)}) held at the reference point's "
                    "during the check: the function autograd differentiates",
                )
            )

    def finish(self) -> str | None:
        """After a replayed call of the loss: why it could not be replayed (noted once), else ``None``."""
        if self.mismatch is None and self.recorded is not None and self._position < len(self.recorded):
            self.mismatch = f"it detached {self._position} tensor(s), {len(self.recorded)} in the reference pass"
        if self.mismatch is not None and not any(note.code == NoteCode.DETACHED_MISMATCH for note in self.notes):
            self.notes.append(
                Note(
                    NoteCode.DETACHED_MISMATCH,
                    "the values the loss detaches could not be held at the reference's (" + self.mismatch + "): "
                    "the points where that happened read as not finite",
                )
            )
        return self.mismatch

    def value_of(self, loss: float) -> float:
        """``loss``, NaN when the evaluation could not be replayed."""
        return math.nan if self.finish() is not None else loss

    def in_scope(self) -> bool:
        """Whether a ``detach`` made now would be held (recorded or replayed)."""
        return self.active and self._scoped()

    def _scoped(self) -> bool:
        if self._inside_depth.count > 0:
            return True
        return self.outside is not None and self._model_depth.count == 0 and not self._recomputing

    def detach(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One ``detach`` call within the scope: recorded, replayed or passed on."""
        tensor = args[0] if args and isinstance(args[0], Tensor) else None
        if tensor is None or not self._scoped():
            return func(*args, **kwargs)
        if self._recording:
            result = func(*args, **kwargs)
            held = result.clone() if tensor.requires_grad else None
            self._pending.append(_Detached(held, tensor.shape, tensor.dtype))
            return result
        if self._recomputing:
            return self._recomputed(func, tensor, args, kwargs)
        return self._replayed(func, tensor, args, kwargs)

    def _replayed(self, func: Callable[..., Any], tensor: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        recorded = self.recorded or []
        position, self._position = self._position, self._position + 1
        if self.mismatch is not None:
            return func(*args, **kwargs)
        if position >= len(recorded):
            self.mismatch = f"it detached more than the {len(recorded)} tensor(s) of the reference pass"
            return func(*args, **kwargs)
        entry = recorded[position]
        floating = entry.dtype.is_floating_point and tensor.dtype.is_floating_point
        if tuple(entry.shape) != tuple(tensor.shape) or (entry.dtype != tensor.dtype and not floating):
            self.mismatch = (
                f"detach {position + 1} was of a {tuple(tensor.shape)} {tensor.dtype}, of a {tuple(entry.shape)} "
                f"{entry.dtype} in the reference pass"
            )
            return func(*args, **kwargs)
        value = None if entry.value is None else entry.value.to(device=tensor.device, dtype=tensor.dtype, copy=True)
        if torch.is_grad_enabled() and self.inside and self._inside_depth.count > 0:
            # a detach the reference made on a tensor that required no grad is not held, but its recomputation is
            # known too: a culprit search's zero leaf on a constant input makes that tensor require grad now
            self._forward_pairs.append((tensor.detach().clone(), value))  # detach on a tensor: not this mode's
        return func(*args, **kwargs) if value is None else value

    def _recomputed(
        self, func: Callable[..., Any], tensor: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        for argument, value in self._forward_pairs:
            if argument.shape == tensor.shape and argument.dtype == tensor.dtype and torch.equal(argument, tensor):
                return func(*args, **kwargs) if value is None else value.clone()
        if tensor.requires_grad:  # one that does not depends on no parameter: the forward did not hold it either
            self.mismatch = "an activation checkpoint recomputed a detach the forward did not make"
        return func(*args, **kwargs)


_DISPATCH = ("torch.", "gradwatch.engine.function.modes", __name__)
"""The modules a ``detach`` passes through to reach :class:`_HeldMode` (none of this module's own reaches it: a mode
is off while it handles an operation)."""


def _checks_own() -> bool:
    """Whether the ``detach`` being dispatched was called by the check's own code (the culprit search's hooks on the
    model's modules), not by the loss: the first caller outside :data:`_DISPATCH` is in :mod:`gradwatch.engine`."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_DISPATCH):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("gradwatch.engine.")


class _HeldMode(OperationMode):
    """Sends the ``detach`` calls of the loss to its :class:`HeldDetaches`."""

    def __init__(self, held: HeldDetaches) -> None:
        super().__init__()
        self._held = held

    def operation(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func in _DETACHES and not _checks_own():
            return self._held.detach(func, args, kwargs)
        return func(*args, **kwargs)
