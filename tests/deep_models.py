"""A deep Llama-like transformer in plain torch with a planted 2% backward bug in one chosen tensor, for the detection
latency test (``tests/engine/test_deep_detection.py``) and ``benchmarks/deep_detection.py``.

Each weight (and each module's input) passes through :class:`ScaledGradient` in its module's ``forward``, an identity
whose backward scales the gradient by the module's ``grad_factor`` (``input_factor``; 1 is correct): a wrong backward
of that one module. A wrong weight gradient touches one tensor, whose share of the whole gradient is small in a deep
model (a layer-8 MLP down projection holds ~1e-3 of ``‖g‖²``); a wrong input gradient makes every tensor upstream of
the module wrong, by a little each.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ScaledGradient(torch.autograd.Function):
    """The identity, whose backward scales the gradient by ``factor``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(weight: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        return weight.view_as(weight)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, float], output: Tensor) -> None:  # type: ignore[override]
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.factor, None


class Planted(nn.Module):
    """A module with one ``weight`` whose gradient its backward scales by ``grad_factor``, and the gradient of its input
    by ``input_factor``."""

    grad_factor = 1.0
    input_factor = 1.0
    weight: nn.Parameter

    def planted_weight(self) -> Tensor:
        return self.weight if self.grad_factor == 1.0 else ScaledGradient.apply(self.weight, self.grad_factor)

    def planted_input(self, x: Tensor) -> Tensor:
        return (
            x if self.input_factor == 1.0 or not x.is_floating_point() else ScaledGradient.apply(x, self.input_factor)
        )


class Linear(Planted):
    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(outputs, inputs) / inputs**0.5)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.planted_input(x), self.planted_weight())


class RMSNorm(Planted):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        x = self.planted_input(x)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.planted_weight()


class Embedding(Planted):
    def __init__(self, vocabulary: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocabulary, width))

    def forward(self, tokens: Tensor) -> Tensor:
        return F.embedding(tokens, self.planted_weight())


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = Linear(width, width), Linear(width, width)
        self.v_proj, self.o_proj = Linear(width, width), Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape

        def split(h: Tensor) -> Tensor:
            return h.view(batch, length, self.heads, width // self.heads).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        scores = q @ k.transpose(-1, -2) / (width // self.heads) ** 0.5
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.o_proj((weights @ v).transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = Linear(width, hidden), Linear(width, hidden)
        self.down_proj = Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(width), Attention(width, heads)
        self.post_attention_layernorm, self.mlp = RMSNorm(width), MLP(width, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepLlama(nn.Module):
    """A Llama-like decoder (RMSNorm, causal attention, SwiGLU MLP, untied head), random init."""

    def __init__(self, layers: int = 12, width: int = 32, heads: int = 4, hidden: int = 64, vocabulary: int = 64):
        super().__init__()
        self.embed_tokens = Embedding(vocabulary, width)
        self.layers = nn.ModuleList(Layer(width, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.lm_head = Linear(width, vocabulary)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


DEEP_TENSORS = (
    "layers.8.self_attn.q_proj",
    "layers.6.self_attn.o_proj",
    "layers.4.mlp.up_proj",
    "layers.8.mlp.down_proj",
    "layers.10.post_attention_layernorm",
    "embed_tokens",
)
"""The modules whose weight gradient the benchmark gets wrong, one at a time: attention q and o, MLP up and down, a norm
weight, the embedding."""


def deep_llama(
    bug_at: str | None = None, factor: float = 1.02, seed: int = 0, *, wrong_input: bool = False, **sizes: int
) -> DeepLlama:
    """The model, with the weight gradient of module ``bug_at`` (its input gradient with ``wrong_input``) scaled by
    ``factor`` (``None``: correct)."""
    torch.manual_seed(seed)
    model = DeepLlama(**sizes)
    if bug_at is not None:
        module = model.get_submodule(bug_at)
        assert isinstance(module, Planted)
        if wrong_input:
            module.input_factor = factor
        else:
            module.grad_factor = factor
    return model


def language_model_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    logits = model(batch[0])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


def token_batches(count: int, seed: int = 0, size: int = 4, length: int = 16, vocabulary: int = 64) -> list[Any]:
    """Synthetic next-token batches: random tokens and their shift by one."""
    generator = torch.Generator().manual_seed(1000 + seed)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, vocabulary, (size, length + 1), generator=generator)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches
