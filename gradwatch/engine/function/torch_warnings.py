"""PyTorch's own warnings that a gradient may be silently incorrect, seen while a check runs the loss.

Autograd backpropagates through an operator that has no autograd kernel (a plain ``torch.distributed.all_reduce``
inside a loss, a custom operator registered without its backward) as if it were the identity, and says so once:
"c10d::allreduce_: an autograd kernel was not registered to the Autograd key(s) but we are trying to backprop through
it. This may lead to silently incorrect behavior" (ms-swift #9778). Such a warning is a finding of the check, not
noise: :func:`incorrect_gradient_notes` turns every distinct one raised during a check into a note naming the operator.

Python shows a warning once per place (the ``__warningregistry__`` of the module it is attributed to): by the time a
check runs, training's own first backward has usually shown it, and the check's evaluations would raise nothing.
:func:`torch_registries_cleared` empties the registries of PyTorch's own modules (where the C++ warnings of the
autograd engine are attributed) for the duration and puts back exactly what they held: the check sees the warnings
again, and training, after it, shows what it would have shown without the check.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from gradwatch.engine.results.notes import Note, NoteCode

_UNREGISTERED = re.compile(
    r"(?:\w+Warning: )?(?P<operator>[\w:.]+): an autograd kernel was not registered to the Autograd key"
)
"""The autograd engine's warning for an operator without an autograd kernel (``autograd_not_implemented_fallback``)."""

_OF_ITS_KIND = ("silently incorrect", "incorrect gradient", "gradients will be incorrect", "incorrect results")
"""Words of PyTorch's other warnings that a gradient or a result may be wrong without an error."""


@contextlib.contextmanager
def torch_registries_cleared() -> Iterator[None]:
    """Empty the warning registries of PyTorch's modules for the duration (see the module doc), then put back what
    each held, so that a warning shown once in training is raised again during a check and no more afterwards."""
    held = [namespace[_REGISTRY] for namespace in _torch_namespaces() if _REGISTRY in namespace]
    saved = [(registry, dict(registry)) for registry in held if isinstance(registry, dict) and registry]
    for registry, _ in saved:
        registry.clear()
    try:
        yield
    finally:
        # a module imported during the check has its registry emptied too
        for registry in [namespace[_REGISTRY] for namespace in _torch_namespaces() if _REGISTRY in namespace]:
            if isinstance(registry, dict):
                registry.clear()
        for registry, entries in saved:
            registry.update(entries)


_REGISTRY = "__warningregistry__"
"""Where ``warnings`` keeps a module's "shown once" entries: in the globals of the code that warned, the module's
``__dict__`` (so a module's own ``__getattr__``, a lazy module's, is never asked for it)."""

_namespaces: tuple[tuple[int, str | None], list[dict[str, Any]]] = ((-1, None), [])
"""The ``__dict__`` of every PyTorch module, with the state of ``sys.modules`` it was read from (its length and last
name): a check reads it in microseconds, where walking ``sys.modules`` (thousands of modules once Lightning or
transformers are imported) took milliseconds twice a check."""


def _torch_namespaces() -> list[dict[str, Any]]:
    """The ``__dict__`` of every PyTorch module in ``sys.modules``, read again only when a module was imported since
    (``sys.modules`` keeps the order modules were added in)."""
    global _namespaces
    modules = sys.modules
    state = (len(modules), next(reversed(modules), None))
    if _namespaces[0] != state:
        found = [getattr(module, "__dict__", None) for name, module in list(modules.items()) if _is_torch(name)]
        _namespaces = (state, [namespace for namespace in found if isinstance(namespace, dict)])
    return _namespaces[1]


def _is_torch(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


def incorrect_gradient_notes(withheld: Iterable[str]) -> list[Note]:
    """A note for each distinct warning among ``withheld`` (``"Category: message"``) in which PyTorch says a gradient
    may be silently incorrect: naming the operator without an autograd kernel, or quoting the warning's first
    sentence."""
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
