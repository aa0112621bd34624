"""The clip check a watch makes after the loop clipped a verified gradient (``after_clipping``): the coefficient
against the verified gradient's norms, from the clipped ``.grad`` or, for an engine that clips in its own partitions,
from the norm it says it clipped with."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from gradwatch.engine import CheckReport
from gradwatch.engine.applied.clipping import check_clip_norm, check_clipping
from gradwatch.watch.applied import Verified
from gradwatch.watch.optimized import gradients_of

__all__ = ["UNREAD_CLIP", "clip_check"]

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
