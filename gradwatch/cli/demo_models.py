"""The example models of ``gradwatch demo``, trained on synthetic data made on the spot (re-exported by
``examples/models.py`` for the examples and benchmarks): :class:`HealthyClassifier` (correct gradients: dropout and
BatchNorm are exactly what naive gradient checks trip over), and three planted bugs. :class:`CustomNormClassifier`'s
hand-written RMSNorm backward (``correct_backward=False``) treats the RMS as a constant and drops a term of the input
gradient, about 1/sqrt(width) of it, which training survives silently and a reader easily misses;
:class:`ScaledGradClassifier` multiplies one weight's gradient by 1.01 (a leftover loss-scale or clipping factor), the
smallest bug of the set; :class:`DetachedPenaltyClassifier` adds an L2 penalty of detached weights: every parameter's
gradient misses ``2 * l2 * w``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


def synthetic_classification(
    samples: int = 2048, features: int = 32, classes: int = 4, label_noise: float = 0.1, seed: int = 0
) -> TensorDataset:
    """Overlapping Gaussian clusters with a fraction of random labels: learnable, but the loss does not collapse to
    zero within a few steps, so gradients keep a realistic size through the run."""
    generator = torch.Generator().manual_seed(seed)
    centres = 0.5 * torch.randn(classes, features, generator=generator)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    inputs = centres[labels] + torch.randn(samples, features, generator=generator)
    noisy = torch.rand(samples, generator=generator) < label_noise
    labels[noisy] = torch.randint(0, classes, (int(noisy.sum()),), generator=generator)
    return TensorDataset(inputs, labels)


def synthetic_loader(batch_size: int = 64, seed: int = 0, **kwargs: Any) -> DataLoader:
    """A shuffling DataLoader over :func:`synthetic_classification` (deterministic for a given seed)."""
    dataset = synthetic_classification(seed=seed, **kwargs)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))


class RMSNormFunction(torch.autograd.Function):
    """``y = x / rms(x) * weight`` over the last dimension, with a hand-written backward.

    ``correct=False`` reproduces a common mistake: differentiating as if ``rms(x)`` did not depend on ``x``. Written as
    ``torch.func`` wants a Function (``forward`` without ``ctx``, ``setup_context``, ``generate_vmap_rule``), so that
    gradwatch can evaluate its checks' points in vectorised passes."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, weight: Tensor, eps: float, correct: bool) -> Tensor:  # type: ignore[override]
        return x / _rms(x, eps) * weight

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, float, bool], output: Tensor) -> None:  # type: ignore[override]
        x, weight, eps, correct = inputs
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        ctx.correct = correct

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, Tensor, None, None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        rms = _rms(x, ctx.eps)
        normalized = x / rms
        grad_normalized = grad_output * weight
        grad_x = grad_normalized / rms
        if ctx.correct:
            # d(1/rms)/dx: the term the buggy version forgets
            grad_x = grad_x - normalized * (grad_normalized * normalized).mean(dim=-1, keepdim=True) / rms
        grad_weight = (grad_output * normalized).reshape(-1, weight.numel()).sum(dim=0)
        return grad_x, grad_weight, None, None


def _rms(x: Tensor, eps: float) -> Tensor:
    return x.pow(2).mean(dim=-1, keepdim=True).add(eps).sqrt()


class RMSNorm(nn.Module):
    """RMSNorm through :class:`RMSNormFunction`."""

    def __init__(self, width: int, correct_backward: bool = True, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps
        self.correct_backward = correct_backward

    def forward(self, x: Tensor) -> Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps, self.correct_backward)


class HealthyClassifier(pl.LightningModule):
    """A small MLP classifier with BatchNorm and Dropout: correct gradients."""

    def __init__(self, features: int = 32, hidden: int = 64, classes: int = 4, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Linear(features, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, labels = batch
        loss = F.cross_entropy(self(inputs), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class CustomNormClassifier(HealthyClassifier):
    """The classifier with a custom-Function RMSNorm; ``correct_backward=False`` plants the bug."""

    def __init__(self, correct_backward: bool = True, features: int = 32, hidden: int = 64, classes: int = 4) -> None:
        super().__init__(features, hidden, classes)
        self.net = nn.Sequential(
            nn.Linear(features, hidden),
            RMSNorm(hidden, correct_backward=correct_backward),
            nn.GELU(),
            nn.Dropout(0.1),
            nn.Linear(hidden, classes),
        )


class ScaledGradClassifier(HealthyClassifier):
    """The healthy classifier, but a hook multiplies the gradient of ``net.4.weight`` by ``factor``."""

    def __init__(self, factor: float = 1.01) -> None:
        super().__init__()
        self.factor = factor
        weight: Tensor = self.net[4].weight  # type: ignore[assignment]
        weight.register_hook(self._scale)

    def _scale(self, grad: Tensor) -> Tensor:
        return grad * self.factor


class DetachedPenaltyClassifier(HealthyClassifier):
    """The healthy classifier with an L2 penalty on its weights that autograd cannot see (``weight.detach()``)."""

    def __init__(self, l2: float = 0.01) -> None:
        super().__init__()
        self.l2 = l2

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, labels = batch
        # the bug: the penalty is built from detached tensors (as one would to log it), so it adds to the loss only
        penalty = sum(p.detach().pow(2).sum() for p in self.parameters())
        loss = F.cross_entropy(self(inputs), labels) + self.l2 * penalty
        self.log("train_loss", loss, prog_bar=True)
        return loss
