"""Substituting tensors for a model's parameters wherever the model holds them, and putting every one back.

A module may be reachable under several names: a decoder that reuses the encoder (``self.dec = self.enc``), a
marginal-likelihood object holding the model and its likelihood a second time, Lightning Fabric's wrapper holding the
user's module as ``_forward_module`` and ``_original_module``, weights tied between two modules. Substituting by name
(``torch.nn.utils.stateless``) visits such a slot once per name: the second visit records the first one's substitute
as the "original", and the restore leaves it in place. The model then trains on float64 copies, or on a tensor batched
by ``vmap``. :func:`substituted` swaps by identity instead: every module object once, each slot holding a replaced
tensor once, all restored in reverse order.

What holds a parameter outside the module tree (a likelihood object of a Gaussian-process library keeping the model's
noise parameter, a module registered nowhere under the model) still sees the original: a substituted evaluation is then
another function. :class:`OriginalsSeen`, active during a substituted evaluation, tells when the loss uses an original.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import Tensor, nn

from gradwatch.engine.function.modes import OperationMode
from gradwatch.errors import OutsideTreeError

_Slot = tuple[dict[str, Any], str, Tensor]
"""A module's ``_parameters`` or ``_buffers`` table, a name in it and the tensor it holds."""


def _slots(model: nn.Module, wanted: Mapping[int, Tensor]) -> list[_Slot]:
    """Every slot of the model's modules (each module object once) whose tensor is one of ``wanted``."""
    found: list[_Slot] = []
    for module in model.modules():  # each module object once, however many names reach it
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and id(tensor) in wanted:
                    found.append((table, name, tensor))
    return found


@contextlib.contextmanager
def substituted(model: nn.Module, replacements: Mapping[int, Tensor]) -> Iterator[None]:
    """Let ``model`` see ``replacements[id(t)]`` wherever it holds the parameter or buffer ``t``, for the duration: the
    tables are changed directly (a plain tensor may stand in for a ``Parameter``), and each slot gets exactly the
    object it held back."""
    slots = _slots(model, replacements)
    done: list[_Slot] = []
    try:
        for table, name, original in slots:
            table[name] = replacements[id(original)]
            done.append((table, name, original))
        yield
    finally:
        for table, name, original in reversed(done):
            table[name] = original


class OriginalsSeen(OperationMode):
    """Raises :class:`OutsideTreeError` when an operation receives one of ``originals`` (by ``id``: the tensors a
    substitution replaced) while the module tree holds their substitutes."""

    def __init__(self, originals: Mapping[int, str]) -> None:
        super().__init__()
        self._originals = originals

    def operation(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.check(func, args, kwargs)
        return func(*args, **kwargs)

    def check(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise :class:`OutsideTreeError` if the operation receives an original: this mode's job, which another mode
        active in the same place may do in its stead (one dispatch per operation, not two)."""
        if getattr(func, "__name__", "") == "__get__":  # reading an attribute (``.grad``, ``.shape``) uses no value
            return
        originals = self._originals  # run at every operation of a substituted evaluation: no tuple built per argument
        for value in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(value, (list, tuple)):
                for item in value:
                    if id(item) in originals and isinstance(item, Tensor):
                        self._refuse(item)
            elif id(value) in originals and isinstance(value, Tensor):
                self._refuse(value)

    def _refuse(self, original: Tensor) -> None:
        raise OutsideTreeError(
            f"the loss uses {self._originals[id(original)]} from outside the module tree (an object that holds it "
            "besides the model), where gradwatch cannot substitute it"
        )
