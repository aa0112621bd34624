"""PyTorch's own warnings that a gradient may be silently incorrect, seen while a check runs the loss.

Autograd backpropagates through an operator that has no autograd kernel (a plain ``torch.distributed.all_reduce``
inside a loss, a custom operator registered without its backward) as if it were the identity, and says so once:
"c10d::allreduce_: an autograd kernel was not registered to the Autograd key(s) but we are trying to backprop through
it. This may lead to silently incorrect behavior" (ms-swift #9778). Such a warning is a finding of the check, not
noise: :func:`incorrect_gradient_notes` turns every distinct one raised during a check into a note naming the operator.

Python shows a warning once per place (the ``__warningregistry__`` of the module it is attributed to): training's first
backward has usually shown it before a check runs. :func:`torch_registries_cleared` empties the registries of
PyTorch's own modules (where the autograd engine's C++ warnings are attributed) for the duration and puts back exactly
what they held: the check sees the warnings again, and training after it shows what it would have without the check.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from itertools import compress, repeat
from typing import Any

from gradwatch.engine.results.notes import Note, NoteCode

_UNREGISTERED = re.compile(
    r"(?:\w+Warning: )?(?P<operator>[\w:.]+): an autograd kernel was not registered to the Autograd key"
)
"""The autograd engine's warning for an operator without an autograd kernel (``autograd_not_implemented_fallback``)."""

_OF_ITS_KIND = ("silently incorrect", "incorrect gradient", "gradients will be incorrect", "incorrect results")
"""Words of PyTorch's other warnings that a gradient or a result may be wrong without an error."""


@contextlib.contextmanager
def torch_registries_cleared(warned: Callable[[], bool] = lambda: True) -> Iterator[None]:
    """Empty the warning registries of PyTorch's modules for the duration (see the module doc), then put back what
    each held. ``warned()``, asked on leaving, says whether any warning was shown meanwhile: a registry gains an entry
    only for a warning it shows, so when none was, the other registries need not be read again."""
    saved: dict[str, tuple[dict[Any, Any], dict[Any, Any]]] = {}
    for name, registry in _torch_registries():
        saved[name] = registry, dict(registry)
        registry.clear()
    try:
        yield
    finally:
        if warned():  # what the check's warnings left in the registries it did not empty (or in new ones)
            for name, registry in _torch_registries():
                if name not in saved:
                    registry.clear()
        for registry, held in saved.values():
            registry.clear()
            registry.update(held)


def _torch_registries() -> list[tuple[str, dict[Any, Any]]]:
    """The warning registry of each of PyTorch's modules that holds something, by module name. Read from the
    module's ``__dict__`` in one ``map``: an attribute lookup would raise and catch an ``AttributeError`` for each of
    the thousand modules without one, or run a module's own ``__getattr__``."""
    names, namespaces = _torch_namespaces()
    found = list(map(dict.get, namespaces, repeat("__warningregistry__")))
    held = compress(zip(names, found, strict=True), found)
    return [(name, registry) for name, registry in held if isinstance(registry, dict)]


_namespaces: tuple[tuple[int, str | None], tuple[str, ...], tuple[dict[str, Any], ...]] = ((0, None), (), ())
"""The names and globals of PyTorch's modules in ``sys.modules``, with the key they were found at
(:func:`_torch_namespaces`)."""


def _torch_namespaces() -> tuple[tuple[str, ...], tuple[dict[str, Any], ...]]:
    """The names and globals of PyTorch's imported modules, kept while ``sys.modules`` (a few thousand with
    ``transformers``: milliseconds to read) holds as many names and the same last one: an import appends its module's
    name at the end, so one imported since (or removed and imported again) changes the key."""
    global _namespaces
    modules = sys.modules
    key = (len(modules), next(reversed(modules), None))
    if _namespaces[0] != key:
        names, namespaces = [], []
        for name, module in list(modules.items()):
            namespace = getattr(module, "__dict__", None) if _is_torch(name) else None
            if isinstance(namespace, dict):
                names.append(name)
                namespaces.append(namespace)
        _namespaces = key, tuple(names), tuple(namespaces)
    return _namespaces[1], _namespaces[2]


def _is_torch(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


def incorrect_gradient_notes(withheld: Iterable[str]) -> list[Note]:
    """A note for each distinct warning among ``withheld`` (``"Category: message"``) in which PyTorch says a gradient
    may be silently incorrect, naming the operator or quoting the first sentence."""
    operators: list[str] = []
    others: list[str] = []
    for message in withheld:
        found = _UNREGISTERED.match(message)
        if found is not None:
            operators.append(found["operator"])
        elif any(words in message.lower() for words in _OF_ITS_KIND):
            others.append(message.split(". ")[0])
    notes = [
        Note(
            NoteCode.SILENTLY_INCORRECT,
            f"PyTorch warned while the loss ran that `{operator}` has no autograd kernel: autograd backpropagates "
            "through it as the identity, so the gradient through it is silently wrong wherever the operator is not "
            "the identity (a collective across ranks: use the autograd collectives of torch.distributed.nn)",
        )
        for operator in dict.fromkeys(operators)
    ]
    notes += [
        Note(NoteCode.SILENTLY_INCORRECT, f"PyTorch warned while the loss ran that a gradient may be wrong: {text}")
        for text in dict.fromkeys(others)
    ]
    return notes
