"""A sandbox for the user's code during a check: whatever the loss changes in the module tree is put back.

A check calls ``loss_fn`` dozens of times, and user code has side effects: it appends the loss to
``self.training_step_outputs``, counts samples, caches ``self.last_logits``, updates torchmetrics metrics. Beyond the
parameters, buffers and random states (:class:`~gradwatch.engine.function.state.TrainingState`), :class:`Sandbox`
restores the rest of the module tree:

* every attribute of every module (``module.__dict__`` without ``nn.Module``'s own bookkeeping), also of modules kept
  in plain lists and dicts (a dict of torchmetrics metrics);
* the lists, dicts, sets and deques those attributes hold, in place (their contents, not only the binding), at any
  depth up to :data:`MAX_DEPTH`;
* tensors held by an attribute or a dict entry that the loss changed in place (a metric's ``self.tp += tp``), from a
  copy taken beforehand (up to :data:`COPY_LIMIT` elements in all).

What it cannot put back (a global, a file, an object of the user's own class or a tensor kept in a list changed in
place) :meth:`Sandbox.unrestorable` names where it can see it. Side effects are detected, not guessed:
:meth:`Sandbox.settle` compares the tree with the snapshot after the first evaluation; from then on just what changed
is restored after every evaluation (each then computes the same function), and everything at the end of the check.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch.engine.function.guard import MODULE_DICTS
from gradwatch.engine.function.values import listed
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.errors import RestoreError

MODULE_BOOKKEEPING = frozenset({"training", "_is_full_backward_hook", *MODULE_DICTS})
"""``nn.Module`` attributes that are not user state: structure and hooks (parameters, buffers and modes are restored by
``TrainingState``; hooks belong to whoever registered them)."""

COPY_LIMIT = 2**26
"""The most tensor elements the sandbox copies before a check (256 MiB of float32); tensors beyond it are watched by
their version counter only, and an in-place change to one is reported, not undone."""

MAX_DEPTH = 8
"""How deep the sandbox follows containers inside containers."""

_CONTAINERS = (Tensor, nn.Module, list, collections.deque, dict, set, tuple)


@dataclass(eq=False)
class _Saved:
    """What one object looked like before the check."""

    value: Any
    kind: str  # "tensor", "module", "list", "dict", "set", "tuple"
    version: int | None = None
    copy: Tensor | None = None
    contents: Any = None  # a module's attributes, a list's items, a dict's items, a set's members
    children: list[tuple[str, _Saved]] = field(default_factory=list)


class Sandbox:
    """The user state of the tree of ``model``, saved so that a check leaves no trace in it; the tensors of ``exclude``
    (by ``id``: parameters and buffers, which ``TrainingState`` restores) are left alone."""

    def __init__(self, model: nn.Module, exclude: set[int]) -> None:
        self._exclude = exclude
        self._copied = 0
        self._saved: dict[int, _Saved] = {}
        self._modules: list[tuple[str, _Saved]] = []  # every module reached, with its path
        for name, module in model.named_modules():
            self._snapshot(module, name, 0)
        self._watched: list[_Saved] | None = None
        self.changed: list[str] = []
        """What the first evaluation changed, as paths a user would type (``"training_step_outputs"``,
        ``"train_acc.tp"``); empty when the loss leaves the tree alone."""

    # ---- saving ---------------------------------------------------------------------------------------------------

    def _snapshot(self, value: Any, path: str, depth: int, copy: bool = True) -> _Saved:
        known = self._saved.get(id(value))
        if known is not None:
            return known  # shared (or cyclic): saved once, restored once
        if isinstance(value, Tensor):
            saved = _Saved(value, "tensor", version=_version(value))
            if copy and saved.version is not None and self._copied + value.numel() <= COPY_LIMIT:
                with torch.no_grad():
                    saved.copy = value.detach().clone()
                self._copied += value.numel()
            self._saved[id(value)] = saved
            return saved
        kind = _kind(value)
        saved = _Saved(value, kind)
        self._saved[id(value)] = saved
        if kind == "module":
            self._modules.append((path, saved))
            saved.contents = _attributes(value)
            items: Iterable[tuple[Any, Any]] = saved.contents.items()
        elif kind == "list":
            saved.contents = list(value)
            items = enumerate(saved.contents)
        elif kind == "dict":
            saved.contents = list(value.items())
            items = saved.contents
        elif kind == "set":
            saved.contents = set(value)
            items = ()
        else:  # a tuple: immutable, but what it holds may not be
            items = enumerate(value)
        if depth < MAX_DEPTH:
            for key, item in items:
                if isinstance(item, _CONTAINERS) and not (isinstance(item, Tensor) and id(item) in self._exclude):
                    where = _join(path, key, attribute=kind == "module")
                    # tensors kept in lists are accumulated, not updated in place: they are not copied
                    child = self._snapshot(item, where, depth + 1, copy=kind in ("module", "dict"))
                    saved.children.append((where, child))
        return saved

    # ---- restoring ------------------------------------------------------------------------------------------------

    def settle(self) -> list[str]:
        """After the first evaluation: record what it changed (:attr:`changed`, returned), put it back, and from then
        on watch just that."""
        changed = [(path, saved) for path, saved in self._walk() if _differs(saved)]
        self._watched = [saved for _, saved in changed]
        self.changed = [path for path, saved in changed for path in _describe(path, saved)]
        self.restore_watched()
        return self.changed

    @property
    def settled(self) -> bool:
        """Whether :meth:`settle` has run."""
        return self._watched is not None

    def restore_watched(self) -> None:
        """Put back what the first evaluation changed (everything, before :meth:`settle`)."""
        if self._watched is None:
            self.restore()
            return
        for saved in self._watched:
            try:
                _restore(saved)
            except Exception as error:
                raise RestoreError(f"gradwatch could not restore the loss's changes: {error}") from error

    def restore(self) -> None:
        """Put back everything saved that differs now. Every part is attempted; the first error is raised afterwards."""
        errors = []
        for path, saved in self._walk():  # every object, parents before what they hold
            if _differs(saved):
                try:
                    _put_back(saved)
                except Exception as error:  # keep restoring the rest
                    errors.append(RestoreError(f"gradwatch could not restore {path or 'the model'}: {error}"))
        if errors:
            raise errors[0]

    def unrestorable(self) -> list[str]:
        """Tensors the loss changed in place that the sandbox could not put back (it had no copy of them)."""
        walked = self._walk()
        return [path for path, saved in walked if saved.kind == "tensor" and saved.copy is None and _differs(saved)]

    def notes(self, unrestorable: Sequence[str]) -> list[Note]:
        """What a report says of the loss's side effects, or of what of them could not be put back
        (``unrestorable``)."""
        if unrestorable:
            return [
                Note(
                    NoteCode.STATE_UNRESTORED,
                    f"the loss changed {listed(list(unrestorable), 6)} in place, which gradwatch kept no copy of and "
                    "could not put back; move that code into `loss_fn=`",
                )
            ]
        if not self.changed:
            return []
        return [
            Note(
                NoteCode.STATE_RESTORED,
                f"the loss changes the model's state ({listed(self.changed, 6)}); gradwatch put it back after every "
                "evaluation",
            )
        ]

    def _walk(self) -> Iterator[tuple[str, _Saved]]:
        """Every saved object, each once, with the path it was first reached by."""
        visited: set[int] = set()
        for path, module in self._modules:
            yield from _subtree(path, module, visited)


def _subtree(path: str, saved: _Saved, visited: set[int]) -> Iterator[tuple[str, _Saved]]:
    if id(saved) in visited:
        return
    visited.add(id(saved))
    yield path, saved
    for child_path, child in saved.children:
        if child.kind != "module":  # modules are walked from the list of modules
            yield from _subtree(child_path, child, visited)


def _kind(value: Any) -> str:
    if isinstance(value, nn.Module):
        return "module"
    if isinstance(value, (list, collections.deque)):
        return "list"
    if isinstance(value, dict):
        return "dict"
    if isinstance(value, set):
        return "set"
    return "tuple"


def _attributes(module: nn.Module) -> dict[str, Any]:
    return {key: value for key, value in module.__dict__.items() if key not in MODULE_BOOKKEEPING}


def _version(tensor: Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # inference tensors have no version counter (and cannot be changed in place outside it)
        return None


def _join(path: str, key: Any, attribute: bool = False) -> str:
    """``path.key`` for a module's attribute, ``path[key]`` for an item."""
    if attribute:
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def _describe(path: str, saved: _Saved) -> list[str]:
    """The paths a change to ``saved`` reads as: a module's changed attributes, else the object itself."""
    if saved.kind != "module":
        return [path]
    current = _attributes(saved.value)
    keys = {k for k in current.keys() | saved.contents.keys() if current.get(k, _MISSING) is not saved.contents.get(k)}
    return [_join(path, key, attribute=True) for key in sorted(keys)]


def _same_items(a: Iterable[Any], b: Iterable[Any]) -> bool:
    return all(x is y for x, y in zip(a, b, strict=True))


def _differs(saved: _Saved) -> bool:
    """Whether the object itself no longer looks as saved (its children are compared on their own)."""
    value = saved.value
    kind = saved.kind
    if kind == "tensor":
        return saved.version is not None and _version(value) != saved.version
    if kind == "module":
        current = _attributes(value)
        return current.keys() != saved.contents.keys() or any(current[k] is not v for k, v in saved.contents.items())
    if kind == "list":
        return len(value) != len(saved.contents) or not _same_items(value, saved.contents)
    if kind == "dict":
        items = list(value.items())
        return len(items) != len(saved.contents) or not all(
            (k is j or k == j) and v is w for (k, v), (j, w) in zip(items, saved.contents, strict=True)
        )
    if kind == "set":
        return value != saved.contents
    return False


def _restore(saved: _Saved) -> None:
    """Put one object back, then whatever it holds that changed (modules apart: they are restored on their own)."""
    if _differs(saved):
        _put_back(saved)
    for _, child in saved.children:
        if child.kind != "module" and (child.children or child.copy is not None or child.kind != "tensor"):
            _restore(child)


def _put_back(saved: _Saved) -> None:
    value = saved.value
    kind = saved.kind
    if kind == "tensor":
        if saved.copy is not None:
            with torch.no_grad():
                value.copy_(saved.copy)
            saved.version = value._version  # the copy counts as a change: this is the version to leave behind
    elif kind == "module":
        attributes = value.__dict__
        for key in [k for k in attributes if k not in MODULE_BOOKKEEPING and k not in saved.contents]:
            del attributes[key]
        for key, item in saved.contents.items():
            if attributes.get(key, _MISSING) is not item:
                attributes[key] = item
    elif kind == "list":
        if isinstance(value, collections.deque):
            value.clear()
            value.extend(saved.contents)
        else:
            value[:] = saved.contents
    elif kind in ("dict", "set"):
        value.clear()
        value.update(saved.contents)


_MISSING = object()
