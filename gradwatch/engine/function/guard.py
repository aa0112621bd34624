"""What the loss does to the model itself during a check, undone: parameter values, structure, hooks.

A loss is user code, and some of it changes the model it is given: a projection or clamp of a weight (``with
torch.no_grad(): w.clamp_(-c, c)``, WGAN's ``p.data.clamp_``), weight normalisation by hand, a forward hook registered
at every call, a submodule added or replaced, a parameter rebound (``fc.weight = nn.Parameter(...)``),
``requires_grad`` toggled. A check calls the loss dozens of times: without care such changes accumulate (24 hooks on a
layer after one check, a weight scaled by 1.001 twenty-four times) and survive the check.

:class:`ModelGuard` saves, when the check starts, the model's structure (each module's class and the dicts
``nn.Module`` keeps its parameters, buffers, submodules and hooks in; torch's global module hooks; each parameter's
``requires_grad``, storage and tensor hooks) and a copy of its parameters (up to :data:`PARAMETER_COPY_LIMIT` elements).
The first evaluation of a check is compared with that, in full: what it changed is put back at once and watched; after
every later evaluation just the watched part is put back, to what it was before that evaluation (gradwatch itself moves
parameters and swaps float64 copies in between). At the end of the check everything is compared with the start and put
back. Parameters whose values the loss changes (:attr:`ModelGuard.edited`) cannot be probed (the function of them the
loss evaluates is not the one autograd differentiates): the check leaves them out, with a note.

Version counters make the comparison cheap; values are compared bit for bit only where a counter cannot see a change
(an edit through ``.data``), once after the first evaluation and once at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.modules.module as torch_module
from torch import Tensor, nn

from gradwatch.engine.notes import Note, NoteCode
from gradwatch.engine.report import CheckAbandonedError

PARAMETER_COPY_LIMIT = 2**26
"""The most parameter elements of which a check keeps a copy (256 MiB of float32). Beyond it an in-place change of a
parameter by the loss is seen by its version counter after the first evaluation; the values it had before that one
change cannot be put back, and the report names them (:attr:`~gradwatch.engine.report.CheckReport.unrestored`)."""

MODULE_DICTS = (
    "_parameters",
    "_buffers",
    "_modules",
    "_non_persistent_buffers_set",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
"""The containers ``nn.Module`` keeps its structure in (the rest of a module's state is the sandbox's)."""

GLOBAL_HOOKS = tuple(name for name in dir(torch_module) if name.startswith("_global_") and name.endswith("hooks"))
"""torch's hooks on every module (``nn.modules.module.register_module_forward_hook``)."""

TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


class LossCallsBackwardError(CheckAbandonedError, ValueError):
    """``loss_fn`` called ``backward()`` itself (a parameter's ``.grad`` changed while gradwatch evaluated it)."""


def loss_calls_backward(evidence: str) -> str:
    """The message of a :class:`LossCallsBackwardError`, with what showed it."""
    return (
        f"`loss_fn` must return the loss without calling backward() on it ({evidence}): gradwatch differentiates the "
        "loss it returns itself. The parameters, their .grad and the optimizers' state were put back. Pass a loss_fn "
        "that only computes the loss (with Lightning's manual optimization: GradWatch(loss_fn=...))"
    )


def loss_gradient(loss: Tensor, wrt: list[Tensor]) -> list[Tensor | None]:
    """``torch.autograd.grad`` of the loss (``None`` for a tensor the loss made not require grad); a graph the loss
    already ran backward through is said in gradwatch's words."""
    differentiable = [t for t in wrt if t.requires_grad]
    try:
        found = iter(torch.autograd.grad(loss, differentiable, allow_unused=True) if differentiable else ())
        return [next(found) if t.requires_grad else None for t in wrt]
    except RuntimeError as error:
        if "backward through the graph a second time" in str(error):
            raise LossCallsBackwardError(loss_calls_backward("its graph was already freed by a backward")) from error
        raise


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors hold the same bits (NaNs and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_floating_point() or a.is_complex():
        integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
        if integer is not None and not a.is_complex():
            return torch.equal(a.view(integer), b.view(integer))
        return torch.equal(
            torch.view_as_real(a) if a.is_complex() else a, torch.view_as_real(b) if b.is_complex() else b
        )
    return torch.equal(a, b)


def _local(tensor: Tensor) -> Tensor:
    """The tensor this process holds: a sharded parameter's local shard (no collective), else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor.detach()


@dataclass(eq=False)
class _Slot:
    """One attribute of one object as it was: a container's items, or a value (a class, a flag, a storage)."""

    owner: Any
    attribute: str
    path: str
    value: Any
    items: list[tuple[Any, Any]] | frozenset[Any] | None

    @classmethod
    def take(cls, owner: Any, attribute: str, path: str) -> _Slot:
        value = owner.__class__ if attribute == "__class__" else getattr(owner, attribute, None)
        if isinstance(value, dict):
            return cls(owner, attribute, path, value, list(value.items()))
        if isinstance(value, set):
            return cls(owner, attribute, path, value, frozenset(value))
        return cls(owner, attribute, path, value, None)

    def again(self) -> _Slot:
        """The same attribute as it is now."""
        return _Slot.take(self.owner, self.attribute, self.path)

    def differs(self) -> bool:
        current = self.owner.__class__ if self.attribute == "__class__" else getattr(self.owner, self.attribute, None)
        if current is not self.value and not (self.attribute == "requires_grad" and current == self.value):
            return True
        if isinstance(self.items, list):
            return len(current) != len(self.items) or any(
                current.get(key, _MISSING) is not item for key, item in self.items
            )
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


@dataclass(eq=False)
class _Parameter:
    """A parameter as the check found it."""

    tensor: Tensor
    path: str
    alias: Tensor  # shares the storage the parameter had (``.data`` rebound is put back to it)
    copy: Tensor | None
    version: int
    slots: list[tuple[nn.Module, str]]

    def storage_moved(self) -> bool:
        t, a = self.tensor, self.alias
        if hasattr(t, "to_local"):  # a sharded parameter: its shards are the sharding's business
            return False
        return t.data_ptr() != a.data_ptr() or t.shape != a.shape or t.stride() != a.stride() or t.dtype != a.dtype


class ModelGuard:
    """The structure and parameter values of a model, saved when a check starts; see the module docstring.

    Args:
        model: The checked module.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._parameters: list[_Parameter] = []
        by_identity: dict[int, _Parameter] = {}
        copied = 0
        for module_path, module in model.named_modules(remove_duplicate=False):
            for key, parameter in module._parameters.items():
                if parameter is None:
                    continue
                saved = by_identity.get(id(parameter))
                if saved is None:
                    local = _local(parameter)
                    copy = None
                    if copied + local.numel() <= PARAMETER_COPY_LIMIT:
                        copy = local.clone()
                        copied += local.numel()
                    path = f"{module_path}.{key}" if module_path else key
                    saved = _Parameter(parameter, path, parameter.detach(), copy, parameter._version, [])
                    by_identity[id(parameter)] = saved
                    self._parameters.append(saved)
                saved.slots.append((module, key))
        self._start = self._scan()
        self._baseline: list[_Slot] | None = None  # before the first evaluation
        self._watched: list[_Slot] | None = None  # what the first evaluation changed
        self._before: list[_Slot] = []
        self._bound: list[tuple[_Parameter, Tensor, bool]] = []
        self.edited: list[_Parameter] = []
        """Parameters whose value, storage, ``requires_grad`` or binding the first evaluation changed."""
        self.changed: list[str] = []
        """What the loss changed in the model's structure, as paths (``"fc._forward_hooks"``)."""
        self.lost: list[str] = []
        """Parameters the loss changed in place of which no copy was kept: their values before the check are lost."""

    # ---- saving ---------------------------------------------------------------------------------------------------

    def _scan(self) -> list[_Slot]:
        slots: list[_Slot] = []
        for path, module in self._model.named_modules():
            where = path or "model"
            slots.append(_Slot.take(module, "__class__", where))
            slots += [_Slot.take(module, name, f"{where}.{name}") for name in MODULE_DICTS if name in module.__dict__]
            slots.append(_Slot.take(module, "_is_full_backward_hook", f"{where}._is_full_backward_hook"))
        for saved in self._parameters:
            slots.append(_Slot.take(saved.tensor, "requires_grad", f"{saved.path}.requires_grad"))
            slots += [_Slot.take(saved.tensor, name, f"{saved.path}.{name}") for name in TENSOR_HOOKS]
        slots += [_Slot.take(torch_module, name, f"torch.nn.modules.module.{name}") for name in GLOBAL_HOOKS]
        return slots

    # ---- around every evaluation ----------------------------------------------------------------------------------

    def before_evaluation(self) -> None:
        """Save what an evaluation may change: everything before the first one, the watched part before the others."""
        if self._watched is None:
            if self._baseline is None:
                self._baseline = self._scan()
                for parameter in self._parameters:
                    parameter.version = parameter.tensor._version
            return
        self._before = [slot.again() for slot in self._watched]
        self._bound = [(p, b, b.requires_grad) for p in self.edited for b in self._bindings(p)]

    def after_evaluation(self) -> None:
        """Put back what the evaluation changed; after the first one, learn what the loss changes."""
        if self._watched is None:
            self._settle()
            return
        for slot in self._before:
            if slot.differs():
                slot.put_back()
        with torch.no_grad():
            for parameter, bound, requires_grad in self._bound:
                if bound.requires_grad != requires_grad:
                    bound.requires_grad_(requires_grad)
                if parameter.copy is not None:
                    _local(bound).copy_(parameter.copy)

    def _bindings(self, parameter: _Parameter) -> Iterator[Tensor]:
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
        self.changed = [slot.path for slot in changed]
        toggled = {id(slot.owner) for slot in changed if slot.attribute == "requires_grad"}
        rebound = {
            id(old)
            for slot in changed
            if slot.attribute == "_parameters" and isinstance(slot.items, list)
            for key, old in slot.items
            if slot.value.get(key, _MISSING) is not old
        }
        for slot in changed:
            slot.put_back()
        for parameter in self._parameters:
            moved = parameter.storage_moved()
            if moved:
                parameter.tensor.data = parameter.alias
            values = self._values_changed(parameter)
            if moved or values or id(parameter.tensor) in toggled | rebound:
                self.edited.append(parameter)
                if moved or values:
                    self.changed.append(parameter.path)
            if values and parameter.copy is None:
                self.lost.append(parameter.path)
                parameter.copy = _local(parameter.tensor).clone()  # from now on, this is the value evaluations start at
        self._put_back_values()

    def _values_changed(self, parameter: _Parameter) -> bool:
        if parameter.tensor._version != parameter.version:
            return True
        return parameter.copy is not None and not same_bits(_local(parameter.tensor), parameter.copy)

    def _put_back_values(self) -> None:
        with torch.no_grad():
            for parameter in self._parameters:
                if parameter.copy is not None and not same_bits(_local(parameter.tensor), parameter.copy):
                    _local(parameter.tensor).copy_(parameter.copy)

    # ---- at the end -------------------------------------------------------------------------------------------------

    def restore(self) -> None:
        """Put the structure and the parameter values back as they were when the check started."""
        for slot in self._start:
            if slot.differs():
                slot.put_back()
                if slot.path not in self.changed:
                    self.changed.append(slot.path)
        for parameter in self._parameters:
            if parameter.storage_moved():
                parameter.tensor.data = parameter.alias
        self._put_back_values()

    def edited_ids(self) -> set[int]:
        """``id`` of each parameter the loss changes (see :attr:`edited`)."""
        return {id(parameter.tensor) for parameter in self.edited}

    def notes(self) -> list[Note]:
        """What a report says of the loss's changes to the model, known after the check."""
        if not self.changed:
            return []
        shown = ", ".join(self.changed[:6]) + (f" and {len(self.changed) - 6} more" if len(self.changed) > 6 else "")
        return [
            Note(
                NoteCode.MODEL_EDITED,
                f"the loss changes the model itself ({shown}); gradwatch put it back after every evaluation",
            )
        ]

    def unrestorable(self) -> list[str]:
        """What could not be put back: parameters changed in place of which no copy was kept."""
        return [f"{path} (its value before the check: no copy was kept)" for path in self.lost]


_MISSING = object()
