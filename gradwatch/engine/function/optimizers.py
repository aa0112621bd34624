"""Optimizer state a loss touches during a check, put back.

A loss that steps an optimizer (``opt.step()`` inside ``loss_fn``) or changes its hyperparameters (an LR schedule
stepped in ``training_step``) would leave the optimizer as no run without the check would have it.
:class:`OptimizerGuard` saves, when a check starts, the optimizers it is given (``optimizers=``; the Lightning callback
gives the trainer's): their parameter groups, which parameters have state, each state entry and its tensors' version
counters. It watches every ``Optimizer.step`` in the process for the duration: an optimizer stepped during the check,
given or not, has its state tensors copied before its first step, which is then undone. A state tensor changed in
place outside ``step`` has no copy: it is named, not put back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradwatch.engine.function.copies import same_bits


def check_optimizers(value: Any) -> tuple[Optimizer, ...]:
    """``optimizers=``: an optimizer, or a list or tuple of them."""
    items = (value,) if isinstance(value, Optimizer) else value
    if isinstance(items, (list, tuple)) and all(isinstance(item, Optimizer) for item in items):
        return tuple(items)
    raise ValueError(
        "`optimizers` must be a torch.optim.Optimizer or a list or tuple of them (the optimizers the loss may step or "
        f"change, whose state the check puts back); got {value!r} ({type(value).__name__})"
    )


@dataclass(eq=False)
class _SavedOptimizer:
    optimizer: Optimizer
    name: str
    groups: list[dict[str, Any]]
    group_items: list[list[tuple[str, Any]]]
    group_params: list[list[Tensor]]
    entries: dict[Tensor, tuple[dict[str, Any], list[tuple[str, Any]]]]
    _: KW_ONLY
    versions: dict[tuple[int, str], int]
    attributes: dict[str, Any]
    copies: dict[tuple[int, str], Tensor] | None = None
    lost: list[str] = field(default_factory=list)

    @classmethod
    def take(cls, optimizer: Optimizer, name: str) -> _SavedOptimizer:
        groups = list(optimizer.param_groups)
        entries = {p: (entry, list(entry.items())) for p, entry in optimizer.state.items()}
        versions = {
            (id(p), key): value._version
            for p, (entry, _) in entries.items()
            for key, value in entry.items()
            if isinstance(value, Tensor) and not value.is_inference()
        }
        attributes = {
            key: value
            for key, value in vars(optimizer).items()
            if isinstance(value, (bool, int, float, str)) or value is None
        }
        items, params = [list(group.items()) for group in groups], [list(group["params"]) for group in groups]
        return cls(optimizer, name, groups, items, params, entries, versions=versions, attributes=attributes)

    def copy_state(self) -> None:
        """Copy the state tensors, once (before a step)."""
        if self.copies is not None:
            return
        self.copies = {}
        with torch.no_grad():
            for p, entry in self.optimizer.state.items():
                for key, value in entry.items():
                    if isinstance(value, Tensor):
                        self.copies[(id(p), key)] = value.detach().clone()

    def restore(self) -> None:
        optimizer = self.optimizer
        optimizer.param_groups[:] = self.groups
        for group, items, params in zip(self.groups, self.group_items, self.group_params, strict=True):
            group.clear()
            group.update(items)
            group["params"][:] = params
        state = optimizer.state
        for p in [p for p in state if p not in self.entries]:
            del state[p]
        for p, (entry, items) in self.entries.items():
            if state.get(p) is not entry:
                state[p] = entry
            current = dict(entry)
            entry.clear()
            entry.update(items)
            for key, value in items:
                if isinstance(value, Tensor):
                    self._restore_tensor(p, key, value, current.get(key))
        for key, value in self.attributes.items():
            setattr(optimizer, key, value)

    def _restore_tensor(self, p: Tensor, key: str, value: Tensor, current: Any) -> None:
        copy = None if self.copies is None else self.copies.get((id(p), key))
        if copy is not None:
            if not same_bits(value.detach(), copy):
                with torch.no_grad():
                    value.copy_(copy)
        elif (id(p), key) in self.versions and value._version != self.versions[(id(p), key)]:
            self.lost.append(f"{self.name}.state[{key!r}]")


class OptimizerGuard:
    """The ``optimizers`` whose state the loss may change, saved when a check starts (see the module doc)."""

    def __init__(self, optimizers: Sequence[Optimizer]) -> None:
        self._saved = {id(o): _SavedOptimizer.take(o, f"optimizers[{i}]") for i, o in enumerate(optimizers)}
        self.stepped: list[str] = []
        """The optimizers stepped during the check (by the loss), as ``type`` names."""
        self._handle = register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        saved = self._saved.get(id(optimizer))
        if saved is None:
            saved = _SavedOptimizer.take(optimizer, type(optimizer).__name__)
            self._saved[id(optimizer)] = saved
        saved.copy_state()
        self.stepped.append(type(optimizer).__name__)

    def restore(self) -> None:
        """Put every saved optimizer back (all of them, the first error raised after) and stop watching steps."""
        self._handle.remove()
        errors = []
        for saved in self._saved.values():
            try:
                saved.restore()
            except Exception as error:  # keep restoring the others
                errors.append(error)
        if errors:
            raise errors[0]

    def unrestorable(self) -> list[str]:
        """State tensors changed in place outside a step (no copy was kept)."""
        return [name for saved in self._saved.values() for name in saved.lost]
