"""What the tests of idle steps share: a record of the tensor operations a block dispatches, and of the hooks on a
model and its optimizer, so that a test can say that the watch's calls on a step where no check is due did nothing
to either (its cost, which wall time cannot assert, is ``benchmarks/idle_calls.py``'s)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.optim.optimizer as optimizers
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class DispatchedOperations(TorchDispatchMode):
    """The tensor operations (ATen) dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.operations: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.operations.append(str(func))
        return func(*args, **(kwargs or {}))


def recorded(call: Callable[..., Any], operations: list[str], active: Callable[[], bool]) -> Callable[..., Any]:
    """``call``, the tensor operations it dispatches appended to ``operations`` while ``active()``."""

    @functools.wraps(call)
    def recording(*args: Any, **kwargs: Any) -> Any:
        if not active():
            return call(*args, **kwargs)
        mode = DispatchedOperations()
        with mode:
            result = call(*args, **kwargs)
        operations.extend(mode.operations)
        return result

    return recording


def global_hooks() -> int:
    """How many global hooks every module and optimizer runs (``register_module_forward_hook``,
    ``register_optimizer_step_pre_hook``, ...): taken before a test's run, as what code before it left installed."""
    modules = torch.nn.modules.module
    return (
        len(optimizers._global_optimizer_pre_hooks) + len(optimizers._global_optimizer_post_hooks)
        + len(modules._global_forward_hooks) + len(modules._global_forward_pre_hooks)
    )  # fmt: skip


def hooks(model: nn.Module, optimizer: torch.optim.Optimizer, *, before: int = 0) -> int:
    """How many hooks the model's modules and parameters and the optimizer hold (and the optimizer an Accelerate
    wrapper wraps), with the global ones installed since there were ``before`` (:func:`global_hooks`)."""
    count = global_hooks() - before
    for own in {id(optimizer): optimizer, id(inner := getattr(optimizer, "optimizer", optimizer)): inner}.values():
        held = vars(own)
        count += len(held.get("_optimizer_step_pre_hooks", {})) + len(held.get("_optimizer_step_post_hooks", {}))
    for module in model.modules():
        count += len(module._forward_hooks) + len(module._forward_pre_hooks) + len(module._backward_hooks)
        count += len(module._backward_pre_hooks)
    for parameter in model.parameters():
        count += len(parameter._backward_hooks or {})
        count += len(getattr(parameter, "_post_accumulate_grad_hooks", None) or {})
    return count
