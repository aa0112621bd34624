"""A tiny GAN, trained with two optimizers, each on its own loss, for the tests of applied checks per optimizer: a
plain loop (:func:`plain_gan_loop`) and a Lightning module with manual optimization (``tests/lightning``), and the
fault they must catch: a step pre-hook that scales the discriminator's gradient (:func:`scale_on_step`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

LATENT, FEATURES = 4, 6


class GAN(nn.Module):
    """A generator and a discriminator; the generator has dropout, so a check must replay the training's masks."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(LATENT, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, FEATURES))
        self.discriminator = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def _bce(logits: Tensor, target: float) -> Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def discriminator_loss(model: nn.Module, batch: Tensor) -> Tensor:
    """The discriminator's loss: real samples against generated ones (the noise drawn here, the samples detached)."""
    fake = model.generator(torch.randn(batch.shape[0], LATENT).type_as(batch)).detach()
    return _bce(model.discriminator(batch), 1.0) + _bce(model.discriminator(fake), 0.0)


def generator_loss(model: nn.Module, batch: Tensor) -> Tensor:
    """The generator's loss: its samples (new noise) taken for real."""
    return _bce(model.discriminator(model.generator(torch.randn(batch.shape[0], LATENT).type_as(batch))), 1.0)


def real_batches(count: int, size: int = 8) -> list[Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(size, FEATURES, generator=generator) + 1.0 for _ in range(count)]


def scale_on_step(factor: float) -> Callable[[torch.optim.Optimizer, Any, Any], None]:
    """A step pre-hook that scales every gradient its optimizer is about to apply by ``factor``."""

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(factor)

    return hook


def gan_state(model: nn.Module, *optimizers: torch.optim.Optimizer) -> dict[str, Any]:
    """The parameters and optimizer states, to compare runs bit for bit."""
    return {
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "optimizers": [optimizer.state_dict() for optimizer in optimizers],
        "rng": torch.get_rng_state(),
    }
