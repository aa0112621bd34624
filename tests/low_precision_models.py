"""Small models trained in pure 16-bit parameters (``model.to(torch.bfloat16)``, no autocast), as many LLM fine-tunes
run, each with a hand-written kernel whose backward can be wrong only for 16-bit inputs: the test models of
``tests/engine/test_low_precision.py`` and ``benchmarks/low_precision.py``. A Llama-like decoder with an RMSNorm kernel
(:class:`SixteenBitNorm`), a CNN (convolutions, BatchNorm, ReLU, max-pool) and an MLP with a ReLU kernel
(:class:`SixteenBitReLU`).

Each kernel is an autograd Function with its own backward formula, as a fused kernel has: correct in float32 and
float64 (what a float64 or float32 re-evaluation of the model runs), and, with ``factor`` other than 1, off by that
factor when its input is bfloat16 or float16 (a bug in the 16-bit kernel alone).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SixteenBitNorm(torch.autograd.Function):
    """RMSNorm ``x / rms(x) · w`` with a hand-written backward, wrong by ``factor`` only on 16-bit inputs."""

    @staticmethod
    def forward(x: Tensor, weight: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, float], output: Tensor) -> None:  # type: ignore[override]
        x, weight, factor = inputs
        ctx.save_for_backward(x, weight)
        ctx.factor = factor

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf, gf, wf = x.to(compute), grad.to(compute), weight.to(compute)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        normed = xf * rstd
        grad_weight = (gf * normed).reshape(-1, x.shape[-1]).sum(0)
        gn = gf * wf
        grad_x = rstd * (gn - normed * (gn * normed).mean(-1, keepdim=True))
        if x.dtype in (torch.bfloat16, torch.float16):
            grad_weight = grad_weight * ctx.factor
            grad_x = grad_x * ctx.factor
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


class Norm(nn.Module):
    factor = 1.0

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        return SixteenBitNorm.apply(x, self.weight, self.factor)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = Norm(width), Norm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width, bias=False)
        self.up, self.down = nn.Linear(width, 4 * width, bias=False), nn.Linear(4 * width, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, w))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TinyDecoder(nn.Module):
    def __init__(self, layers: int = 2, width: int = 64, heads: int = 4, vocabulary: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = Norm(width)
        self.head = nn.Linear(width, vocabulary, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def sixteen_bit_decoder(dtype: torch.dtype, factor: float = 1.0, seed: int = 0, **sizes: int) -> TinyDecoder:
    """The decoder with every parameter in ``dtype``, its norm kernel's 16-bit backward off by ``factor``."""
    torch.manual_seed(seed)
    model = TinyDecoder(**sizes).to(dtype)
    for module in model.modules():
        if isinstance(module, Norm):
            module.factor = factor
    return model


def decoder_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    logits = model(batch[0])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[1].reshape(-1))


def token_batches(count: int, seed: int = 0, size: int = 4, length: int = 16, vocabulary: int = 128) -> list[Any]:
    """Synthetic next-token batches: random tokens and their shift by one."""
    generator = torch.Generator().manual_seed(1000 + seed)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, vocabulary, (size, length + 1), generator=generator)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


class SixteenBitReLU(torch.autograd.Function):
    """ReLU with a hand-written backward, wrong by ``factor`` only on 16-bit inputs."""

    @staticmethod
    def forward(x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        return x.clamp_min(0)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, float], output: Tensor) -> None:  # type: ignore[override]
        x, factor = inputs
        ctx.save_for_backward(x)
        ctx.factor = factor

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        out = grad * (x > 0).to(grad.dtype)
        return (out * ctx.factor if x.dtype in (torch.bfloat16, torch.float16) else out), None


class KernelReLU(nn.Module):
    factor = 1.0

    def forward(self, x: Tensor) -> Tensor:
        return SixteenBitReLU.apply(x, self.factor)


class SmallCNN(nn.Module):
    """Two blocks of convolution, BatchNorm, ReLU (the second through the kernel) and max-pool, then a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.relu = KernelReLU()
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(self.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


class SmallMLP(nn.Module):
    """Linear, the ReLU kernel, linear, GELU, linear."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(32, width), nn.Linear(width, width), nn.Linear(width, 10)
        self.relu = KernelReLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(F.gelu(self.fc2(self.relu(self.fc1(x)))))


def sixteen_bit_classifier(kind: str, dtype: torch.dtype, factor: float = 1.0, seed: int = 0) -> nn.Module:
    """The ``"cnn"`` or ``"mlp"`` with every parameter in ``dtype``, its ReLU kernel's 16-bit backward off by
    ``factor``."""
    torch.manual_seed(seed)
    model = (SmallCNN() if kind == "cnn" else SmallMLP()).to(dtype)
    for module in model.modules():
        if isinstance(module, KernelReLU):
            module.factor = factor
    return model


def classifier_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]).float(), batch[1])


def image_batches(kind: str, dtype: torch.dtype, count: int, seed: int = 0, size: int = 16) -> list[Any]:
    """Synthetic classification batches in ``dtype``: images for the CNN, vectors for the MLP."""
    generator = torch.Generator().manual_seed(2000 + seed)
    shape = (3, 16, 16) if kind == "cnn" else (32,)
    return [
        (torch.randn(size, *shape, generator=generator).to(dtype), torch.randint(0, 10, (size,), generator=generator))
        for _ in range(count)
    ]
