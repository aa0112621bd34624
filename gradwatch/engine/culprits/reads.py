"""Parameters a module's forward reads directly, through no call of the module that owns them.

A LoRA variant reads its adapter's weights in the layer's own forward (``F.linear(x, self.lora_A["default"].weight)``)
and never calls the ``lora_A`` module; a tied or fused head does the same with another module's weight. A culprit
search that displaces a module's parameters during its own forward cannot place a wrong gradient of those: it belongs
to the module whose forward reads them. :class:`ParameterReads`, active during the first recording of the sites,
notes the innermost module running when an operation reads such a parameter; :func:`direct_reads` turns that into the
parameters each module's forward reads, relative to it, which the recording then displaces as that module's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import reduce
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch.engine.function.dataflow import top_level_tensors
from gradwatch.engine.function.modes import OperationMode

_NOT_READS = {Tensor.detach, torch.detach, Tensor.data.__get__, Tensor.grad.__get__}  # type: ignore[attr-defined,union-attr]
"""Operations that return a parameter's tensor without passing its gradient on."""


class ParameterReads(OperationMode):
    """Notes in ``readers[name]``, for each trainable parameter an operation reads as itself, the innermost module
    running (``running()``: ``None`` outside every recorded call)."""

    def __init__(self, running: Callable[[], str | None]) -> None:
        super().__init__()
        self._running = running
        self._names: dict[int, str] = {}
        self.readers: dict[str, set[str]] = {}

    def observe(self, model: nn.Module) -> None:
        """Look for the model's trainable floating parameters, as its modules hold them now."""
        self._names = {id(p): name for name, p in model.named_parameters() if p.is_floating_point() and p.requires_grad}

    def operation(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        grad = torch.is_grad_enabled()
        result = func(*args, **kwargs)
        running = self._running() if self._names and func not in _NOT_READS else None
        if running is None:
            return result
        read = [self._names[id(t)] for t in top_level_tensors((*args, *kwargs.values())) if id(t) in self._names]
        # a read that passes the parameter's values on (a matmul, a cast, a transpose), not a look at its shape or
        # dtype: with gradients on, into a result that requires grad; with them off, into any floating result (the
        # forward of a custom autograd Function runs with gradients off, and its ``apply`` is not seen here)
        results = top_level_tensors(result if isinstance(result, tuple) else (result,))
        made = [t for t in results if t.is_floating_point()]
        if read and any(t.requires_grad or not grad for t in made):
            for name in read:
                self.readers.setdefault(name, set()).add(running)
        return result


def within(name: str, ancestor: str) -> bool:
    """Whether the module ``name`` is ``ancestor`` or inside it."""
    return ancestor == "" or name == ancestor or name.startswith(f"{ancestor}.")


def direct_reads(readers: Mapping[str, set[str]], running: set[str]) -> dict[str, list[str]]:
    """By module name, the parameters its forward reads directly, relative to it (``"lora_A.default.weight"``): each
    one whose owner is not among the modules that ran (``running``), given to the innermost one that ran and holds
    both the parameter and every module that read it."""
    found: dict[str, list[str]] = {}
    for name, modules in readers.items():
        owner = name.rpartition(".")[0]
        if owner in running:
            continue
        holders = [m for m in running if within(owner, m) and all(within(r, m) for r in modules)]
        if not holders:
            continue
        reader = max(holders, key=len)
        found.setdefault(reader, []).append(name[len(reader) + 1 :] if reader else name)
    return found


def attribute(module: nn.Module, name: str) -> Any:
    """``module``'s attribute at the dotted path ``name`` (``"lora_A.default.weight"``)."""
    return reduce(getattr, name.split("."), module)
