"""Models, planted path faults and a tiny training loop for the applied-gradient tests and benchmark.

Every fault here lives on the training's path only: eager float32 autograd of the same loss stays right (except the
``formula`` hook, which both kinds of check must see). Synthetic data made on the spot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradwatch.engine.applied import AppliedWindow

Batch = tuple[Tensor, Tensor]


class AutocastOnlyTanh(torch.autograd.Function):
    """``tanh`` whose backward is ``factor`` times too large when its forward ran under CPU autocast (or on bfloat16
    inputs, as autocast feeds it): right in eager float32, wrong on a bf16-mixed path."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        ctx.scale = factor if torch.is_autocast_enabled("cpu") or x.dtype == torch.bfloat16 else 1.0
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y) * ctx.scale, None


class MLP(nn.Module):
    """Linear, tanh (optionally the autocast-only faulty one), dropout, linear."""

    def __init__(self, autocast_fault: float = 1.0, width: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(width, 4)
        self.autocast_fault = autocast_fault

    def forward(self, x: Tensor) -> Tensor:
        h = AutocastOnlyTanh.apply(self.fc1(x), self.autocast_fault)
        return self.fc2(self.drop(h))


class CNN(nn.Module):
    """Convolutions with BatchNorm, ReLU, max-pool and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(self.drop(x.flatten(1)))


class ConvBatchNorm(nn.Module):
    """A convolution before BatchNorm (a gradient whose float32 rounding can reach far above the rest's: the floor
    that keeps the combined probes from vouching for the others), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.adaptive_avg_pool2d(F.relu(self.conv2(x)), 4)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class Transformer(nn.Module):
    """A one-layer transformer encoder with dropout over 6 tokens, mean-pooled into a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(self.embed(x)).mean(1))


class ChannelsLastPool(nn.Module):
    """``adaptive_max_pool3d`` on a channels-last-3d input: its backward is wrong when compiled at batch 16
    (pytorch#197888, still wrong in torch 2.13 on CPU), right eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 3, 1)
        self.fc = nn.Linear(3 * 8, 4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv(x).contiguous(memory_format=torch.channels_last_3d)
        return self.fc(F.adaptive_max_pool3d(y, 2).flatten(1))


def batch_for(model: nn.Module, size: int = 16, seed: int = 0) -> Batch:
    """A classification batch of the shape ``model`` takes."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {MLP: (8,), CNN: (3, 16, 16), Transformer: (6, 8), ChannelsLastPool: (2, 4, 4, 4)}
    x = torch.randn(size, *shapes[type(model)], generator=generator)
    if isinstance(model, ChannelsLastPool):
        x = x.contiguous(memory_format=torch.channels_last_3d)
    return x, torch.randint(0, 4, (size,), generator=generator)


def cross_entropy(model: nn.Module, batch: Batch) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def bf16() -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def train_window(
    model: nn.Module,
    batches: list[Batch],
    path: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    *,
    zero: bool = True,
    forward: nn.Module | None = None,
) -> AppliedWindow:
    """One accumulation window of a plain loop (``zero=False`` forgets ``zero_grad``): records the window, runs each
    micro-batch's forward (through ``forward``, e.g. the compiled module, if given) under ``path`` and backward of its
    loss divided by the window size."""
    if zero:
        model.zero_grad(set_to_none=True)
    window = AppliedWindow(model)
    for batch in batches:
        window.record(batch)
        with path() if path is not None else contextlib.nullcontext():
            loss = cross_entropy(forward if forward is not None else model, batch)
        (loss / len(batches)).backward()
    return window


@contextlib.contextmanager
def scaled_once(param: Tensor, factor: float) -> Iterator[None]:
    """A gradient hook on ``param`` that scales its gradient by ``factor`` the first time it fires, then never again
    (a transient fault)."""
    fired = [False]

    def hook(grad: Tensor) -> Tensor:
        if fired[0]:
            return grad
        fired[0] = True
        return grad * factor

    handle = param.register_hook(hook)
    try:
        yield
    finally:
        handle.remove()
