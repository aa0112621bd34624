"""A model whose kernel refuses float64, as Triton and fused CUDA kernels do, for the tests of checks that must then
probe in the native precision (``tests/engine/test_native_kernels.py``).

:class:`FusedLinear` stands for such a kernel: a linear map with a hand-written backward that raises on float64
inputs; ``factor`` scales the weight gradient its backward returns (1 is correct).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class FusedLinearFunction(torch.autograd.Function):
    """``x @ wᵀ`` that refuses float64, with the weight gradient scaled by ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        if x.dtype == torch.float64 or weight.dtype == torch.float64:
            raise TypeError("fused_linear: float64 is not supported by this kernel")
        ctx.save_for_backward(x, weight)
        ctx.factor = factor
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad @ weight, grad_weight * ctx.factor, None


class FusedLinear(nn.Module):
    def __init__(self, inputs: int, outputs: int, factor: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(outputs, inputs) / inputs**0.5)
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return FusedLinearFunction.apply(x, self.weight, self.factor)


class NativeMLP(nn.Module):
    """``down(gelu(up(x)))`` with ``up`` a float32-only kernel."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = FusedLinear(16, 32, factor)
        self.down = nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


def native_batch(seed: int = 0) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(16, 16, generator=generator), torch.randint(0, 4, (16,), generator=generator)


def native_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])
