"""The parameters a watched optimizer updates, and their gradients: what the applied, clip and update checks of one
optimizer's step read (with several optimizers, only that optimizer's parameters are checked)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["gradients_of", "optimizer_argument", "updated_parameters"]


def gradients_of(model: nn.Module, updated: list[tuple[str, nn.Parameter]] | None = None) -> list[torch.Tensor | None]:
    """Each trainable parameter's ``.grad`` (of those an optimizer updates, when given), in order."""
    if updated is not None:
        return [p.grad for _, p in updated]
    return [p.grad for p in model.parameters() if p.requires_grad]


def optimizer_argument(name: str, optimizer: Any) -> Any:
    """``optimizer``: ``None`` or an object with ``param_groups`` (a ``torch.optim.Optimizer``), else a clear error."""
    if optimizer is not None and not isinstance(getattr(optimizer, "param_groups", None), list):
        kind = type(optimizer).__name__
        raise ValueError(f"`{name}` must be a torch.optim.Optimizer (with param_groups); got {kind}")
    return optimizer


def updated_parameters(model: nn.Module, optimizer: Any) -> list[tuple[str, nn.Parameter]] | None:
    """The trainable parameters of ``model`` that ``optimizer`` updates, by name (``None`` without an optimizer)."""
    if optimizer is None:
        return None
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    updated = [(name, p) for name, p in model.named_parameters() if id(p) in ids and p.requires_grad]
    if not updated:
        raise ValueError("`optimizer` updates none of the model's trainable parameters")
    return updated
