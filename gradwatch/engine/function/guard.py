"""What the loss does to the model itself during a check, undone: parameter values, structure, hooks.

A loss is user code, and some of it changes the model it is given: a projection or clamp of a weight (``with
torch.no_grad(): w.clamp_(-c, c)``, WGAN's ``p.data.clamp_``), weight normalisation by hand, a forward hook registered
at every call, a submodule added or replaced, a parameter rebound (``fc.weight = nn.Parameter(...)``),
``requires_grad`` toggled. A check calls the loss dozens of times: without care such changes accumulate (24 hooks on a
layer after one check, a weight scaled by 1.001 twenty-four times) and survive the check.

:class:`ModelGuard` saves, when the check starts, the model's structure (each module's class and the dicts
``nn.Module`` keeps its parameters, buffers, submodules and hooks in; torch's global module hooks; each parameter's
``requires_grad``, storage and tensor hooks) and a copy of its parameters (:mod:`.copies`). What the first evaluation
changed is put back at once and watched; after every later one just the watched part is put back, to what it was
before that evaluation (gradwatch moves parameters and swaps float64 copies in between); at the end, everything.
Parameters whose values the loss changes (:attr:`ModelGuard.edited`) cannot be probed (the loss evaluates another
function of them than autograd differentiates): the check leaves them out, with a note.

Version counters make the comparison cheap; values are compared bit for bit only where a counter cannot see a change
(an edit through ``.data``), once after the first evaluation and once at the end.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.nn.modules.module as torch_module
from torch import Tensor, nn

from gradwatch.engine.function.copies import FlatCopies, SavedParameter, local_tensor, same_bits
from gradwatch.engine.function.values import listed
from gradwatch.engine.results.notes import Note, NoteCode

MODULE_DICTS = (
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_pre_hooks", "_backward_hooks",
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)  # fmt: skip
"""The containers ``nn.Module`` keeps its structure in (the rest of a module's state is the sandbox's)."""

GLOBAL_HOOKS = tuple(name for name in dir(torch_module) if name.startswith("_global_") and name.endswith("hooks"))
"""torch's hooks on every module (``nn.modules.module.register_module_forward_hook``)."""

TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


_F = TypeVar("_F", bound=Callable[..., Any])


def plain(function: _F) -> _F:
    """Run ``function`` without ``__torch_function__``, which reading an attribute of a ``Parameter`` (a tensor
    subclass) goes through: under the check's own modes a scan of a model's structure would outlast its forward."""

    @functools.wraps(function)
    def unwrapped(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunction():
            return function(*args, **kwargs)

    return unwrapped  # type: ignore[return-value]


class _Slot:
    """One attribute of one object as it was: a container's items, or a value (a class, a flag). Thousands are taken
    per check: a class with ``__slots__``, its path made only when a change is named."""

    __slots__ = ("attribute", "items", "owner", "value", "where")

    def __init__(self, owner: Any, attribute: str, where: str) -> None:
        self.owner = owner
        self.attribute = attribute
        self.where = where
        value: Any = owner.__class__ if attribute == "__class__" else getattr(owner, attribute, None)
        self.value = value
        self.items: tuple[tuple[Any, Any], ...] | frozenset[Any] | None = None
        if isinstance(value, dict):
            self.items = tuple(value.items()) if value else ()
        elif isinstance(value, set):
            self.items = frozenset(value)

    @property
    def label(self) -> str:
        return self.where if self.attribute == "__class__" else f"{self.where}.{self.attribute}"

    def again(self) -> list[_Slot]:
        return [_Slot(self.owner, self.attribute, self.where)]

    def differs(self) -> bool:
        current = self.owner.__class__ if self.attribute == "__class__" else getattr(self.owner, self.attribute, None)
        if current is not self.value and not (self.attribute == "requires_grad" and current == self.value):
            return True
        if isinstance(self.items, tuple):
            if len(current) != len(self.items):
                return True
            for key, item in self.items:  # noqa: SIM110 (a loop starts no generator for a module's few items)
                if current.get(key, _MISSING) is not item:
                    return True
            return False
        if isinstance(self.items, frozenset):
            return current != self.items
        return False

    def put_back(self) -> None:
        if self.attribute == "__class__":
            self.owner.__class__ = self.value
            return
        if self.attribute == "requires_grad":
            self.owner.requires_grad_(self.value)
            return
        if getattr(self.owner, self.attribute, None) is not self.value:
            # a module's own containers sit in its __dict__ (nn.Module.__setattr__ would file them elsewhere)
            setter = object.__setattr__ if isinstance(self.owner, nn.Module) else setattr
            setter(self.owner, self.attribute, self.value)
        if self.items is not None:  # the items of a dict, the members of a set
            self.value.clear()
            self.value.update(self.items)


class _EmptyDicts:
    """The containers of one module that were empty (most of its hook dicts): one object, not one per container."""

    __slots__ = ("dicts", "names", "owner", "where")

    def __init__(self, owner: nn.Module, names: list[str], where: str) -> None:
        self.owner = owner
        self.names = names
        self.where = where
        self.dicts = [owner.__dict__[name] for name in names]

    @property
    def label(self) -> str:
        attributes = self.owner.__dict__
        pairs = zip(self.names, self.dicts, strict=True)
        return ", ".join(f"{self.where}.{n}" for n, d in pairs if attributes.get(n) is not d or d) or self.where

    def differs(self) -> bool:
        # a container filled, or one no longer in its place (in one map each: no generator per comparison)
        return any(self.dicts) or not all(map(operator.is_, map(self.owner.__dict__.get, self.names), self.dicts))

    def put_back(self) -> None:
        attributes = self.owner.__dict__
        for name, container in zip(self.names, self.dicts, strict=True):
            if attributes.get(name) is not container:
                object.__setattr__(self.owner, name, container)
            if container:
                container.clear()

    def again(self) -> list[_Slot]:
        return [_Slot(self.owner, name, self.where) for name in self.names]


class ModelGuard:
    """The structure and parameter values of ``model``, saved when a check starts (see the module doc)."""

    @plain
    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._parameters: list[SavedParameter] = []
        by_identity: dict[int, SavedParameter] = {}
        for module_path, module in model.named_modules(remove_duplicate=False):
            for key, parameter in module._parameters.items():
                if parameter is None:
                    continue
                saved = by_identity.get(id(parameter))
                if saved is None:
                    path = f"{module_path}.{key}" if module_path else key
                    saved = SavedParameter(parameter, path, parameter.detach(), None, parameter._version, [])
                    by_identity[id(parameter)] = saved
                    self._parameters.append(saved)
                saved.slots.append((module, key))
        self._copies = FlatCopies(self._parameters)
        self._start = self._scan()
        self._baseline: list[_Slot | _EmptyDicts] | None = None  # before the first evaluation
        self._watched: list[_Slot | _EmptyDicts] | None = None  # what the first evaluation changed
        self._before: list[_Slot] = []
        self._bound: list[tuple[SavedParameter, Tensor, bool]] = []
        self.edited: list[SavedParameter] = []
        """Parameters whose value, storage, ``requires_grad`` or binding the first evaluation changed."""
        self.changed: list[str] = []
        """What the loss changed in the model's structure, as paths (``"fc._forward_hooks"``)."""
        self.lost: list[str] = []
        """Parameters the loss changed in place of which no copy was kept: their values before the check are lost."""

    # ---- saving ---------------------------------------------------------------------------------------------------

    def _scan(self) -> list[_Slot | _EmptyDicts]:
        slots: list[_Slot | _EmptyDicts] = []
        for path, module in self._model.named_modules():
            where = path or "model"
            attributes = module.__dict__
            slots.append(_Slot(module, "__class__", where))
            present = [name for name in MODULE_DICTS if name in attributes]
            slots += [_Slot(module, name, where) for name in present if attributes[name]]
            slots.append(_EmptyDicts(module, [name for name in present if not attributes[name]], where))
            slots.append(_Slot(module, "_is_full_backward_hook", where))
        for saved in self._parameters:
            slots += [_Slot(saved.tensor, name, saved.label) for name in ("requires_grad", *TENSOR_HOOKS)]
        slots += [_Slot(torch_module, name, "torch.nn.modules.module") for name in GLOBAL_HOOKS]
        return slots

    # ---- around every evaluation ----------------------------------------------------------------------------------

    def before_evaluation(self) -> None:
        """Save what an evaluation may change: everything before the first one, the watched part before the others
        (nothing, where the first one changed nothing: most losses)."""
        if not self._idle:
            self._save_before()

    def after_evaluation(self) -> None:
        """Put back what the evaluation changed; after the first one, learn what the loss changes."""
        if not self._idle:
            self._put_back_after()

    @property
    def _idle(self) -> bool:
        """Whether evaluations have nothing to save or put back: the first one changed nothing."""
        return self._watched is not None and not self._watched and not self.edited

    @plain
    def _save_before(self) -> None:
        if self._watched is None:
            if self._baseline is None:
                # gradwatch may have changed the structure since the start (a sharded check's hooks): then anew
                self._baseline = self._scan() if any(slot.differs() for slot in self._start) else self._start
                for parameter in self._parameters:
                    parameter.version = parameter.tensor._version
            return
        self._before = [again for slot in self._watched for again in slot.again()]
        self._bound = [(p, b, b.requires_grad) for p in self.edited for b in self._bindings(p)]

    @plain
    def _put_back_after(self) -> None:
        if self._watched is None:
            self._settle()
            return
        for slot in self._before:
            if slot.differs():
                slot.put_back()
        if not self._bound:
            return  # no parameter the loss edits: no grad mode to enter and leave after every evaluation
        with torch.no_grad():
            for parameter, bound, requires_grad in self._bound:
                if bound.requires_grad != requires_grad:
                    bound.requires_grad_(requires_grad)
                if parameter.copy is not None:
                    local_tensor(bound).copy_(parameter.copy)

    def _bindings(self, parameter: SavedParameter) -> Iterator[Tensor]:
        """The tensors standing at a parameter's places now (the parameter, or a float64 copy during float64 probes)."""
        seen: set[int] = set()
        for module, key in parameter.slots:
            bound = module._parameters.get(key)
            if isinstance(bound, Tensor) and id(bound) not in seen:
                seen.add(id(bound))
                yield bound

    def _settle(self) -> None:
        baseline = self._baseline if self._baseline is not None else self._start
        changed = [slot for slot in baseline if slot.differs()]
        self._watched = changed
        self.changed = [slot.label for slot in changed]
        toggled = {id(slot.owner) for slot in changed if isinstance(slot, _Slot) and slot.attribute == "requires_grad"}
        rebound = {
            id(old)
            for slot in changed
            if isinstance(slot, _Slot) and slot.attribute == "_parameters" and isinstance(slot.items, tuple)
            for key, old in slot.items
            if slot.value.get(key, _MISSING) is not old
        }
        for slot in changed:
            slot.put_back()
        moved = {id(parameter) for parameter in self._parameters if parameter.storage_moved()}
        for parameter in self._parameters:
            if id(parameter) in moved:
                parameter.tensor.data = parameter.alias
        differing = self._copies.differing()
        for parameter in self._parameters:
            values = parameter.tensor._version != parameter.version or id(parameter) in differing
            if id(parameter) in moved or values or id(parameter.tensor) in toggled | rebound:
                self.edited.append(parameter)
                if id(parameter) in moved or values:
                    self.changed.append(parameter.label)
            if values and parameter.copy is None:
                self.lost.append(parameter.label)
                # from now on, this is the value evaluations start at
                parameter.copy = local_tensor(parameter.tensor).clone()
        self._put_back_values(differing)

    def _put_back_values(self, differing: set[int]) -> None:
        with torch.no_grad():
            for parameter in self._parameters:
                if id(parameter) in differing and parameter.copy is not None:
                    local_tensor(parameter.tensor).copy_(parameter.copy)

    # ---- at the end -------------------------------------------------------------------------------------------------

    @plain
    def restore(self) -> None:
        """Put the structure and the parameter values back as they were when the check started."""
        for slot in self._start:
            if slot.differs():
                path = slot.label
                slot.put_back()
                if path not in self.changed:
                    self.changed.append(path)
        for parameter in self._parameters:
            if parameter.storage_moved():
                parameter.tensor.data = parameter.alias
        differing = self._copies.differing()
        lost = [
            p
            for p in self.edited
            if p.label in self.lost and p.copy is not None and not same_bits(local_tensor(p.tensor), p.copy)
        ]
        self._put_back_values(differing | {id(parameter) for parameter in lost})

    def edited_ids(self) -> set[int]:
        """``id`` of each parameter the loss changes (see :attr:`edited`)."""
        return {id(parameter.tensor) for parameter in self.edited}

    def notes(self) -> list[Note]:
        """What a report says of the loss's changes to the model, known after the check."""
        if not self.changed:
            return []
        return [
            Note(
                NoteCode.MODEL_EDITED,
                f"the loss changes the model itself ({listed(self.changed, 6)}); gradwatch put it back after every "
                "evaluation",
            )
        ]

    def unrestorable(self) -> list[str]:
        """What could not be put back: parameters changed in place of which no copy was kept."""
        return [f"{path} (its value before the check: no copy was kept)" for path in self.lost]


_MISSING = object()
