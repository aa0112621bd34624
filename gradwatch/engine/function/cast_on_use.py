"""Float64 evaluation of a large model without a float64 copy of it: parameters cast to float64 where an operation uses
them, one at a time.

A float64 substitute for every parameter (:func:`~gradwatch.engine.function.precision.float64_storage`) doubles the
float32 parameters held, which beyond the float64 limit a check must not add to a training step's memory. A float64
re-measurement of a few undecided probes moves only their tensors; the others need only *read* as float64.
:class:`CastOnUse` hands every operation that receives one of them its float64 cast instead, which lives while the
operation runs (gradient-free evaluations keep nothing for a backward). An attribute read that returns the parameter's
values (``.T``, ``.mT``, ``.data``) is cast too; ``.shape``, ``.dtype`` and the like pass through.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from gradwatch.engine.function.modes import OperationMode


class CastOnUse(OperationMode):
    """Casts the tensors of ``cast`` (by ``id``: the dtype each is read in, float64 or complex128) wherever an operation
    receives them."""

    def __init__(self, cast: Mapping[int, torch.dtype]) -> None:
        super().__init__()
        self._cast = cast

    def _converted(self, value: Any) -> Any:
        if isinstance(value, Tensor) and id(value) in self._cast:
            return value.detach().to(self._cast[id(value)])
        return value

    def operation(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if getattr(func, "__name__", "") == "__get__":  # an attribute: cast only what holds the tensor's values
            result = func(*args, **kwargs)
            owner = args[0] if args else None
            if (
                isinstance(result, Tensor)
                and isinstance(owner, Tensor)
                and id(owner) in self._cast
                and result.dtype == owner.dtype
                and result.untyped_storage().data_ptr() == owner.untyped_storage().data_ptr()
            ):
                return result.detach().to(self._cast[id(owner)])
            return result
        args, kwargs = tree_map(self._converted, (args, kwargs))
        return func(*args, **kwargs)
