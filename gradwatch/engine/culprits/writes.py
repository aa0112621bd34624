"""Writes behind autograd's back: a tensor an operation saved for its backward, changed before the backward reads it.

A write through ``.data``, or a kernel that writes its result into its input (Liger's cross entropy stores its
gradient in the logits, PR#1251), changes a tensor without bumping its version counter, so autograd cannot tell: the
backward of the operation that saved it computes from the changed values, and the gradient upstream of it is silently
wrong, while every formula on its own is right. A culprit search would name the first module whose gradient turns
wrong, the victim, not the module that wrote.

:func:`writes_behind_autograds_back` runs the loss once more under saved-tensor hooks that take each saved tensor's
checksum when it is saved and when the backward reads it. Where one differs, a second run checks those tensors at every
module's forward hooks: the module running when one changed is the writer (the loss's own code where none was; a
backward, where the forward left it unchanged).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch.engine.culprits.words import LOSS
from gradwatch.engine.function.evaluation import LossEvaluator

BACKWARD = "<backward>"
"""The writer named where the forward left the tensor as it was saved: a backward changed it before another read it."""


@dataclass(frozen=True)
class Write:
    """A saved tensor that changed between its saving and the backward that read it: the module running when it
    changed (``writer``; :data:`~.words.LOSS`: the loss's own code, :data:`BACKWARD`: the backward pass) and when it was
    saved (``saver``), the ``culprits`` (the writer, then the modules containing it) and the ``message``."""

    writer: str
    saver: str
    culprits: list[str]
    message: str


def _checksum(tensor: Tensor) -> tuple[float, float]:
    with torch.no_grad():
        values = tensor.detach()
        if values.is_complex():
            values = torch.view_as_real(values)
        values = values.double()
        return float(values.sum()), float((values * values).sum())


def _storage(tensor: Tensor) -> int | None:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except Exception:  # a tensor without storage (a functional wrapper, a sparse layout): not checked
        return None


class _Saved:
    """The saved-tensor hooks of one run: every saved tensor with its checksum and the module running at its saving;
    the ``watched`` ones (by index) checked at every module hook. Tensors in the storage of the model's buffers are
    left out: a module may update its own in place (BatchNorm's running statistics, saved but read only in eval
    mode)."""

    def __init__(self, buffers: frozenset[int], watched: frozenset[int] = frozenset()) -> None:
        self.buffers = buffers
        self.tensors: list[Tensor] = []
        self.sums: list[tuple[float, float] | None] = []
        self.savers: list[str] = []
        self.changed: set[int] = set()
        self.writers: dict[int, str] = {}
        self.watched = watched
        self.stack: list[str] = []

    def running(self) -> str:
        return self.stack[-1] if self.stack else LOSS

    def pack(self, tensor: Tensor) -> int:
        self.tensors.append(tensor)
        storage = _storage(tensor)
        self.sums.append(None if storage is None or storage in self.buffers else _checksum(tensor))
        self.savers.append(self.running())
        return len(self.tensors) - 1

    def unpack(self, index: int) -> Tensor:
        tensor = self.tensors[index]
        if index not in self.changed and self.sums[index] is not None and _checksum(tensor) != self.sums[index]:
            self.changed.add(index)
            self.writers.setdefault(index, BACKWARD)
        return tensor

    def event(self, running_before: str) -> None:
        """A module hook: the watched tensors that changed since the last one were written by ``running_before``."""
        for index in self.watched:
            if index >= len(self.tensors) or index in self.writers or self.sums[index] is None:
                continue
            if _checksum(self.tensors[index]) != self.sums[index]:
                self.writers[index] = running_before

    def enter(self, name: str) -> None:
        self.event(self.running())
        self.stack.append(name)

    def leave(self, name: str) -> None:
        self.event(self.running())
        if self.stack and self.stack[-1] == name:
            self.stack.pop()


@contextmanager
def _hooked(model: nn.Module, saved: _Saved) -> Iterator[None]:
    handles = []
    try:
        if saved.watched:
            for name, module in model.named_modules():
                handles.append(module.register_forward_pre_hook(lambda *_, name=name: saved.enter(name)))
                handles.append(module.register_forward_hook(lambda *_, name=name: saved.leave(name)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _run(model: nn.Module, evaluator: LossEvaluator, saved: _Saved) -> None:
    """One forward and backward of the loss under ``saved``'s hooks."""
    original = evaluator.loss_fn
    wrt = [p for _, p in evaluator.params if p.requires_grad]

    def audited(module: nn.Module, batch: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack), _hooked(model, saved):
            loss = original(module, batch)
        saved.event(LOSS)  # what the loss's own code wrote after the last module ran
        return loss

    evaluator.loss_fn = audited
    try:
        evaluator.gradients_wrt(lambda: wrt)
    finally:
        evaluator.loss_fn = original


def writes_behind_autograds_back(model: nn.Module, evaluator: LossEvaluator) -> Write | None:
    """The first saved tensor the loss changes behind autograd's back, with the module that wrote it, or ``None``.
    ``evaluator`` must be on the native parameters and inputs."""
    buffers = frozenset(s for s in (_storage(b) for b in model.buffers()) if s is not None)
    first = _Saved(buffers)
    _run(model, evaluator, first)
    if not first.changed:
        return None
    attributed = _Saved(buffers, frozenset(first.changed))
    _run(model, evaluator, attributed)
    index = min(attributed.writers, default=min(first.changed))
    writer = attributed.writers.get(index, BACKWARD)
    saver = attributed.savers[index] if index < len(attributed.savers) else LOSS
    names = dict(model.named_modules())
    parts = writer.split(".")  # the writer, then the modules containing it
    culprits = [writer] if writer in (LOSS, BACKWARD) else [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    return Write(writer, saver, culprits, _message(writer, saver, names, len(first.changed)))


def _described(name: str, names: dict[str, nn.Module]) -> str:
    if name == LOSS:
        return "the loss function's own code"
    if name == BACKWARD:
        return "a backward"
    kind = type(names[name]).__name__ if name in names else "?"
    return f"`{name}` (`{kind}`)" if name else f"the model (`{kind}`)"


def _message(writer: str, saver: str, names: dict[str, nn.Module], count: int) -> str:
    others = f" (and {count - 1} more saved tensor(s))" if count > 1 else ""
    return (
        f"{_described(writer, names)} writes into a tensor that an operation of {_described(saver, names)} saved for "
        f"its backward{others}, behind autograd's back (a .data write or a kernel's in-place output, which bumps no "
        "version counter): the backward reads the changed values, and the gradient upstream of it is wrong though "
        "every formula on its own is right"
    )
