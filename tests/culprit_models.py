"""Models with a planted wrong backward at a known module, for the culprit tests (``tests/engine/test_culprits.py``)
and ``benchmarks/culprits.py``: a deep residual stack, a bug in the loss, in functional code between modules, in a
shared module called twice, in a module with tuple and integer outputs, and in a tiny Hugging Face Llama's RMSNorm."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class WrongInputGradient(torch.autograd.Function):
    """``tanh`` whose backward scales the input gradient by ``factor`` (1 is correct)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, float], output: Tensor) -> None:  # type: ignore[override]
        ctx.save_for_backward(output)
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y) * ctx.factor, None


class Tanh(nn.Module):
    """A hand-written ``tanh``; ``factor`` plants a bug in its backward."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return WrongInputGradient.apply(x, self.factor)


class Block(nn.Module):
    def __init__(self, width: int, factor: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = Tanh(factor)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x + self.act(self.fc(x)))  # a residual stream: the error reaches upstream by two paths


class Stack(nn.Module):
    def __init__(self, depth: int = 6, bug_at: int | None = None, width: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width, 1.03 if i == bug_at else 1.0) for i in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=generator), torch.randint(0, 3, (6,), generator=generator)


def _cross_entropy(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


class WrongLossGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor) -> Tensor:
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad * 1.03


class Functional(nn.Module):
    """A bug in plain functional code between two modules of the model's own forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 12)
        self.second = nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(WrongInputGradient.apply(self.first(x), 1.03))


class Shared(nn.Module):
    """One buggy module called twice (shared weights), between two healthy ones."""

    def __init__(self, factor: float = 1.03) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 12)
        self.shared = nn.Sequential(nn.Linear(12, 12), Tanh(factor))
        self.out = nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.shared(self.shared(self.inp(x))))


class PairOutput(nn.Module):
    """Returns ``(values, indices)``: a floating and an integer output."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.act = Tanh(factor)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = self.act(x)
        return y, y.argmax(-1)


class TupleModel(nn.Module):
    def __init__(self, factor: float = 1.03) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 12)
        self.pair = PairOutput(factor)
        self.out = nn.Sequential(nn.Linear(12, 3), nn.ReLU(inplace=True))  # in place on the activation probed

    def forward(self, x: Tensor) -> Tensor:
        values, indices = self.pair(self.inp(x))
        return self.out(values) + 0.0 * indices.unsqueeze(-1)


def batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=generator), torch.randint(0, 3, (6,), generator=generator)


def cross_entropy(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def loss_with_wrong_backward(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(WrongLossGradient.apply(model(batch[0])), batch[1])


def llama_with_wrong_norm(norm: str | None, layers: int = 3) -> nn.Module:
    """A tiny ``LlamaForCausalLM`` whose RMSNorm ``norm`` (a module name) runs a backward that drops a term."""
    import transformers

    from gradwatch.cli.demo_models import RMSNormFunction

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(config)
    if norm is not None:
        module = dict(model.named_modules())[norm]

        def forward(hidden_states: Tensor) -> Tensor:
            return RMSNormFunction.apply(hidden_states, module.weight, module.variance_epsilon, False)

        module.forward = forward  # type: ignore[method-assign]
    return model


def tokens() -> Tensor:
    return torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))


def causal_lm_loss(model: nn.Module, ids: Tensor) -> Tensor:
    return model(input_ids=ids, labels=ids).loss
