"""What a vectorised pass (``torch.func.vmap`` over the points of a check) changes about the model for its duration.

BatchNorm layers in training mode cannot update one running statistic from many points, and a linear layer whose
weight differs between points is cheaper on flattened rows; both are the same function as the model computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn.functional as F
from torch import Tensor, nn


@contextlib.contextmanager
def running_statistics_frozen(model: nn.Module) -> Iterator[None]:
    """Let BatchNorm layers in training mode normalise by the batch's statistics without updating their running ones
    (their output is the same either way), then put their settings back."""
    frozen = [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
    ]
    for module in frozen:
        module.track_running_stats = False
    try:
        yield
    finally:
        for module in frozen:
            module.track_running_stats = True


@contextlib.contextmanager
def flat_linear() -> Iterator[None]:
    """Let ``torch.nn.functional.linear`` flatten an input of more than two dimensions into rows, for the duration of
    a vectorised pass.

    Under ``vmap``, a linear layer whose weight differs between points and whose input has several leading dimensions
    is computed by broadcasting the weight over them: a copy of the weight per row. Flattened to ``(rows, width)`` it
    is one batched matrix product, rounded alike to within a few units of float64 (the pass's reproduction of the
    centre checks that): 5x faster on the 64-token GPT of the cost benchmark.
    """
    linear = F.linear

    def flat(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if input.dim() <= 2:
            return linear(input, weight, bias)
        return linear(input.reshape(-1, input.shape[-1]), weight, bias).reshape(*input.shape[:-1], -1)

    F.linear = flat  # type: ignore[assignment]
    try:
        yield
    finally:
        F.linear = linear
