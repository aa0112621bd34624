"""What the reference pass learns about the loss's dataflow: inputs it detaches, values it reads out of the graph.

Input probes make the batch's floating tensors require grad for the reference pass. A loss that detaches an input (a
gradient penalty's ``interpolates.detach()``, a PDE residual's ``x.detach().requires_grad_()``) computes a gradient
with respect to it that is deliberately not its derivative: :class:`ReferenceFlow`, active during the reference pass,
finds the inputs a ``detach`` reaches, which are not probed (a note names them).

The same pass tells whether ``torch.func.vmap`` can evaluate the loss at many points at once: a loss that turns a value
computed from the parameters into Python (``x.item()``, ``if x.any():``) or into a data-dependent shape
(``mask.nonzero()``: a mixture of experts' routing) cannot be vectorised, and its points are evaluated one by one from
the start.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from gradwatch.engine.function.modes import OperationMode

_DETACHES = {Tensor.detach, torch.detach, Tensor.detach_, Tensor.data.__get__}  # type: ignore[attr-defined]

_DATA_DEPENDENT = {
    Tensor.item: "item()", Tensor.tolist: "tolist()", Tensor.numpy: "numpy()", Tensor.__bool__: "bool()",
    Tensor.__float__: "float()", Tensor.__int__: "int()", Tensor.__index__: "an index", torch.nonzero: "nonzero()",
    Tensor.nonzero: "nonzero()", torch.argwhere: "argwhere()", torch.masked_select: "masked_select()",
    Tensor.masked_select: "masked_select()", torch.unique: "unique()", Tensor.unique: "unique()",
    torch.unique_consecutive: "unique_consecutive()",
}  # fmt: skip
"""Operations vmap refuses on a batched tensor: a value read into Python, or a shape that depends on the values."""


def _reached_leaves(tensor: Tensor, wanted: Mapping[int, str]) -> set[str]:
    """The paths of the ``wanted`` leaves (by ``id``) ``tensor`` depends on through autograd."""
    if id(tensor) in wanted:
        return {wanted[id(tensor)]}
    found: set[str] = set()
    stack = [tensor.grad_fn] if tensor.grad_fn is not None else []
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None and id(variable) in wanted:
            found.add(wanted[id(variable)])
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return found


def top_level_tensors(values: Any) -> list[Tensor]:
    """The tensors among ``values`` and one level of the lists and tuples in it (an operation's arguments)."""
    found = []
    for value in values:
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, Tensor):
                found.append(item)
    return found


class ReferenceFlow(OperationMode):
    """Records which of the input leaves ``leaves`` (path to tensor) a ``detach`` inside the loss cuts off, and the
    first operation vmap would refuse on a value computed from what the probes move (see the module doc).

    A detach is followed back only from a tensor that requires grad; one whose value the check holds (``held()``
    true: :mod:`.held`) cuts nothing, the gradient it leaves being the derivative the check evaluates. Values computed
    from the parameters are those that require grad and the integer and boolean tensors computed from them (a router's
    ``topk`` indices, ``indices == e``).
    """

    def __init__(self, leaves: Mapping[str, Tensor], held: Callable[[], bool] = lambda: False) -> None:
        super().__init__()
        self._held = held
        self._wanted = {id(tensor): path for path, tensor in leaves.items()}
        self.detached: set[str] = set()
        self.data_dependent: str | None = None
        """The first operation vmap would refuse, in words (``"nonzero()"``), or ``None``."""
        self._derived: dict[int, weakref.ref[Tensor]] = {}  # weak: a freed tensor's id may come back for another

    def operation(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        cutting = func in _DETACHES and args and isinstance(args[0], Tensor) and args[0].requires_grad
        cutting = cutting and not self._held()
        if cutting and len(self.detached) < len(self._wanted):
            self.detached |= _reached_leaves(args[0], self._wanted)
        if self.data_dependent is not None:
            return func(*args, **kwargs)
        derived = self._any_derived(args) or (bool(kwargs) and self._any_derived(kwargs.values()))
        if derived and func in _DATA_DEPENDENT:
            self.data_dependent = _DATA_DEPENDENT[func]
        result = func(*args, **kwargs)
        if not derived:
            return result
        if isinstance(result, Tensor):  # the usual case, one tensor: no list built
            if not result.requires_grad:
                self._derived[id(result)] = weakref.ref(result)
            return result
        for tensor in top_level_tensors(result if isinstance(result, tuple) else (result,)):
            if not tensor.requires_grad:
                self._derived[id(tensor)] = weakref.ref(tensor)
        return result

    def _any_derived(self, values: Iterable[Any]) -> bool:
        """Whether a tensor among ``values`` and one level of the lists and tuples in it (as
        :func:`top_level_tensors` finds them) is computed from what the probes move. Run at every operation of the
        reference pass: a loop that stops at the first, no list built."""
        for value in values:
            if isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, Tensor) and (item.requires_grad or self._is_derived(item)):
                        return True
            elif isinstance(value, Tensor) and (value.requires_grad or self._is_derived(value)):
                return True
        return False

    def _is_derived(self, tensor: Tensor) -> bool:
        ref = self._derived.get(id(tensor))
        return ref is not None and ref() is tensor


def unprobed_note(detached: set[str]) -> str | None:
    """The note naming the inputs a ``detach`` in the loss reaches, which are not probed."""
    if not detached:
        return None
    return (
        f"inputs not probed: {', '.join(sorted(detached))} (the loss detaches them: their gradient is deliberately "
        "not their derivative)"
    )
