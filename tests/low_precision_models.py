"""A small Llama-like decoder trained in pure 16-bit parameters (``model.to(torch.bfloat16)``, no autocast), as many LLM
fine-tunes run, with a hand-written RMSNorm kernel whose backward can be wrong only for 16-bit inputs: the test model of
``tests/engine/test_low_precision.py`` and ``benchmarks/low_precision.py``.

:class:`SixteenBitNorm` is an autograd Function with its own backward formula, as a fused norm kernel has: correct in
float32 and float64 (what a float64 or float32 re-evaluation of the model runs), and, with ``factor`` other than 1, off
by that factor when its input is bfloat16 or float16 (a bug in the 16-bit kernel alone).
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
