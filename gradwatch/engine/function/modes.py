"""The base of the torch function modes that watch or change the operations of the loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.overrides import TorchFunctionMode


class OperationMode(TorchFunctionMode):
    """A ``TorchFunctionMode`` whose subclass handles each operation in :meth:`operation` (``kwargs`` a dict)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.operation(func, args, kwargs or {})

    def operation(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError
