"""Historical gradient bugs that live at one special point of a smooth loss, re-created as custom autograd Functions
(the forward is right everywhere, the backward only at that point is wrong), with the models that sit exactly on that
point at initialisation; for ``tests/engine/test_special_points.py`` and ``benchmarks/edges.py``.

* **BCE with logits at logit 0**: the backward drops ``sigmoid(0)`` where a logit is exactly 0, where a
  zero-initialised classification head puts every logit.
* **Segment product at an exact zero**: the backward divides the product by each factor and, to avoid 0/0, returns 0
  where a factor is exactly 0, though the derivative there is the product of the other factors (sparse count features
  and a zero-initialised bias give exact zeros).
* **``grid_sample`` on the border**: with ``padding_mode="border"``, the backward treats a sample point exactly on the
  border as zeros padding would (the pixel beyond the border as 0), where an identity-initialised warp puts the first
  and last rows and columns of its grid.

At each point the loss is differentiable (its one-sided derivatives agree): a shifted point no longer shows the bug,
so only a check that tells a smooth point from a tie catches it. ``correct=True`` gives the right backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class BCEWithLogits(torch.autograd.Function):
    """``binary_cross_entropy_with_logits`` (mean); ``correct=False``: the backward where a logit is exactly 0 returns
    ``-target`` (``sigmoid(0)`` dropped, as a stable ``where(z > 0, ..., where(z < 0, ...))`` that forgot 0)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(logits: Tensor, target: Tensor, correct: bool) -> Tensor:  # type: ignore[override]
        return F.binary_cross_entropy_with_logits(logits, target)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, bool], output: Tensor) -> None:  # type: ignore[override]
        ctx.save_for_backward(inputs[0], inputs[1])
        ctx.correct = inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        logits, target = ctx.saved_tensors
        probability = torch.sigmoid(logits)
        if not ctx.correct:
            probability = torch.where(logits == 0, torch.zeros_like(probability), probability)
        return grad * (probability - target) / logits.numel(), None, None


class ZeroHead(nn.Module):
    """An MLP whose last layer starts at zero (every logit exactly 0), trained with a hand-written BCE."""

    def __init__(self, correct: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.correct = correct

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


def bce_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return BCEWithLogits.apply(model(batch[0]), batch[1], model.correct)


def bce_batch(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randn(16, 10, generator=generator), torch.randint(0, 2, (16, 3), generator=generator).float()


class SegmentProduct(torch.autograd.Function):
    """The product over segments of ``size`` consecutive features; ``correct=False``: the backward computes
    ``product / factor`` and returns 0 where a factor is exactly 0."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, size: int, correct: bool) -> Tensor:  # type: ignore[override]
        return x.unflatten(-1, (-1, size)).prod(-1)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, int, bool], output: Tensor) -> None:  # type: ignore[override]
        ctx.save_for_backward(inputs[0])
        ctx.size, ctx.correct = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        factors = x.unflatten(-1, (-1, ctx.size))
        if ctx.correct:  # the product of the other factors, computed without dividing
            others = torch.stack(
                [torch.cat([factors[..., :i], factors[..., i + 1 :]], -1).prod(-1) for i in range(ctx.size)], -1
            )
        else:
            product = factors.prod(-1, keepdim=True)
            others = torch.where(factors == 0, torch.zeros_like(factors), product / factors)
        return (grad.unsqueeze(-1) * others).flatten(-2), None, None


class CountFeatures(nn.Module):
    """Sparse counts scaled per feature, with a bias that starts at zero (exact zeros where a count is 0), multiplied
    within segments of 4 features, then a linear head."""

    def __init__(self, correct: bool = False, features: int = 16) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(features) + 0.1 * torch.randn(features))
        self.bias = nn.Parameter(torch.zeros(features))
        self.head = nn.Linear(features // 4, 1)
        self.correct = correct

    def forward(self, counts: Tensor) -> Tensor:
        return self.head(SegmentProduct.apply(counts * self.scale + self.bias, 4, self.correct)).squeeze(-1)


def count_batch(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Counts in {0, 1, 2}, a third of them exactly 0, and a regression target."""
    counts = torch.multinomial(torch.tensor([1.0, 1.0, 1.0]), 16 * 16, replacement=True, generator=generator)
    return counts.reshape(16, 16).float(), torch.randn(16, generator=generator)


def regression_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


class BorderGridSample(torch.autograd.Function):
    """``grid_sample`` with ``padding_mode="border"`` and ``align_corners=True``; ``correct=False``: the gradient of
    the sample points lying exactly on the border is the one zeros padding would give."""

    generate_vmap_rule = True

    @staticmethod
    def forward(image: Tensor, grid: Tensor, correct: bool) -> Tensor:  # type: ignore[override]
        return F.grid_sample(image, grid, padding_mode="border", align_corners=True)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, bool], output: Tensor) -> None:  # type: ignore[override]
        ctx.save_for_backward(inputs[0], inputs[1])
        ctx.correct = inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        image, grid = ctx.saved_tensors
        with torch.enable_grad():
            image_, grid_ = image.detach().requires_grad_(), grid.detach().requires_grad_()
            out = F.grid_sample(image_, grid_, padding_mode="border", align_corners=True)
            image_grad, grid_grad = torch.autograd.grad(out, (image_, grid_), grad)
            if not ctx.correct:
                zeros = F.grid_sample(image_, grid_, padding_mode="zeros", align_corners=True)
                (zeros_grad,) = torch.autograd.grad(zeros, grid_, grad)
                grid_grad = torch.where(grid.abs() == 1, zeros_grad, grid_grad)
        return image_grad, grid_grad, None


class Warp(nn.Module):
    """A spatial transformer whose affine warp starts at the identity, sampling a 12x12 output from a 28x28 image:
    the first and last sample rows and columns lie exactly on the border, the others between pixels."""

    def __init__(self, correct: bool = False) -> None:
        super().__init__()
        self.localisation = nn.Sequential(nn.Conv2d(1, 4, 7, stride=3), nn.Tanh(), nn.Flatten())
        self.theta = nn.Linear(4 * 8 * 8, 6)
        nn.init.zeros_(self.theta.weight)
        with torch.no_grad():
            self.theta.bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0]))
        self.classifier = nn.Linear(12 * 12, 10)
        self.correct = correct

    def forward(self, x: Tensor) -> Tensor:
        theta = self.theta(self.localisation(x)).view(-1, 2, 3)
        grid = F.affine_grid(theta, [x.shape[0], 1, 12, 12], align_corners=True)
        return self.classifier(BorderGridSample.apply(x, grid, self.correct).flatten(1))


def stroke_images(samples: int, generator: torch.Generator, corner_high: int = 24, length_high: int = 12) -> Tensor:
    """MNIST-like 28x28 images: exactly 0 outside three random strokes of 1 each, starting at rows and columns from 4 to
    ``corner_high`` (exclusive), of lengths from 4 to ``length_high`` (exclusive)."""
    images = torch.zeros(samples, 1, 28, 28)
    for image in images:
        for _ in range(3):
            row, col = torch.randint(4, corner_high, (2,), generator=generator).tolist()
            length = int(torch.randint(4, length_high, (1,), generator=generator))
            if torch.rand(1, generator=generator) < 0.5:
                image[0, row, col : col + length] = 1.0
            else:
                image[0, row : row + length, col] = 1.0
    return images


def warp_batch(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """MNIST-like images, normalised (the background is exactly -0.4242), strokes away from the border."""
    images = stroke_images(16, generator, corner_high=16, length_high=9)
    return (images - 0.1307) / 0.3081, torch.randint(0, 10, (16,), generator=generator)


def classification_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


CASES = {
    "BCE with logits, wrong at logit 0": (ZeroHead, bce_batch, bce_loss),
    "segment product, wrong at an exact zero": (CountFeatures, count_batch, regression_loss),
    "grid_sample, wrong on the border": (Warp, warp_batch, classification_loss),
}
"""Name: (model class taking ``correct``, batch from a generator, loss)."""
