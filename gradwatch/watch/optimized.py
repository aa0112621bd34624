"""The parameters a watched optimizer updates, and their gradients: what the applied, clip and update checks of one
optimizer's step read (with several optimizers, only that optimizer's parameters are checked); and the clip check a
watch makes after the loop clipped a verified gradient (``after_clipping``): the coefficient against the verified
gradient's norms, from the clipped ``.grad`` or, for an engine that clips in its own partitions, from the norm it says
it clipped with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradwatch.engine import CheckReport
from gradwatch.engine.applied.clipping import check_clip_norm, check_clipping
from gradwatch.watch.applied import Verified

__all__ = ["UNREAD_CLIP", "clip_check", "gradients_of", "optimizer_argument", "updated_parameters"]


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


UNREAD_CLIP = (
    "gradwatch: the clip check of step {step} cannot read the clipped gradient: the gradient verified was an "
    "engine's own (gradients=), which it clips out of .grad; pass the norm it clipped with as after_clipping(..., "
    "clipped_with=...) (DeepSpeed: engine.get_global_grad_norm after engine.step(), or hand the engine itself) "
    "(said once)"
)


def clip_check(
    verified: Verified, model: nn.Module, max_norm: float, step: int,
    clipped_with: float | Callable[[], float | None] | None, *, say_once: Callable[[str, str], None],
) -> Callable[[], CheckReport] | None:  # fmt: skip
    """The check of the clip coefficient of the gradient verified at ``step``, else ``None`` (nothing to read; a
    gradient an engine clips out of ``.grad`` with no norm given is said once through ``say_once``)."""
    norms = verified.norms
    if clipped_with is not None:
        used = clipped_with() if callable(clipped_with) else clipped_with
        if used is None:
            return None
        return lambda: check_clip_norm(norms, float(used), max_norm, step=step)
    if verified.own:
        return lambda: check_clipping(norms, gradients_of(model), max_norm, step=step)
    say_once("clip", UNREAD_CLIP.format(step=step))
    return None
