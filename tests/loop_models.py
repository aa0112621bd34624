"""Tiny models and data for the tests of the watch in other training loops (plain PyTorch, Lightning Fabric, Hugging
Face's Trainer), and the planted bug they must catch: a hand-written backward whose weight gradient is 2% off in one
module (:class:`real_models.ScaledWeightGradient`, a custom kernel's backward)."""

from __future__ import annotations

from typing import Any

import torch
from real_models import ScaledWeightGradient
from torch import Tensor, nn

VOCAB = 64
BUG = 1.02
"""The planted bug: the weight gradient of one module is 2% too large."""


def plant_bug(linear: nn.Linear, factor: float = BUG) -> None:
    """Route ``linear`` through a hand-written backward whose weight gradient is scaled by ``factor``."""

    def forward(x: Tensor) -> Tensor:
        out = ScaledWeightGradient.apply(x, linear.weight, factor)
        return out if linear.bias is None else out + linear.bias

    linear.forward = forward  # type: ignore[method-assign]


class MLP(nn.Module):
    """A small classifier with dropout, so that a check must replay the random masks exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


def cross_entropy(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def classification_batches(count: int, size: int = 8) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(5)
    return [(torch.randn(size, 8, generator=generator), torch.randint(0, 3, (size,), generator=generator))
            for _ in range(count)]  # fmt: skip


def tiny_llama(bug_in: str | None = None) -> nn.Module:
    """A randomly initialised ``LlamaForCausalLM`` (hidden 32, 2 layers, 4 heads, vocabulary 64), seeded; ``bug_in``
    names a linear module to plant the bug in."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(config)
    if bug_in is not None:
        plant_bug(model.get_submodule(bug_in))
    return model


class Tokens(torch.utils.data.Dataset):
    """Synthetic token sequences, their own labels (causal language modelling)."""

    def __init__(self, count: int = 48, length: int = 12) -> None:
        self.ids = torch.randint(0, VOCAB, (count, length), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What training leaves behind: parameters, buffers, the optimizer's state, the random state."""
    return {
        "model": {name: value.detach().clone() for name, value in model.state_dict().items()},
        "optimizer": [
            {key: value.clone() if isinstance(value, Tensor) else value for key, value in state.items()}
            for state in optimizer.state.values()
        ],
        "rng": torch.get_rng_state(),
    }


def assert_same_state(first: dict[str, Any], second: dict[str, Any]) -> None:
    assert first["model"].keys() == second["model"].keys()
    for name, value in first["model"].items():
        assert torch.equal(value, second["model"][name]), name
    assert len(first["optimizer"]) == len(second["optimizer"])
    for before, after in zip(first["optimizer"], second["optimizer"], strict=True):
        for key, value in before.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after[key])), key
    assert torch.equal(first["rng"], second["rng"])
