"""Small models carrying the gradient bugs that reached public repositories (issue 44), each written the way the
repository had it, with its healthy control:

* a loss term whose backward ignores ``grad_output`` (warp-ctc's binding: the gradient is computed in the forward and
  returned whatever arrives from upstream);
* an axis-angle to quaternion conversion with ``sqrt`` under ``torch.where`` at the identity rotation (kornia #3949:
  the untaken branch's ``sqrt(0)`` back-propagates ``inf * 0 = NaN``), and the fixed formula;
* a module that writes into a softmax's output through ``.data`` after the softmax saved it (Liger's cross entropy
  storing its gradient into its input, PR#1251);
* a ResNet whose blocks end in a zero-initialised BatchNorm (timm's ResNet-18 at initialisation: the residual branch
  adds exactly 0, so many ReLU inputs are exact ties), with a 3% bug planted in one convolution's weight gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ForwardComputedGradient(torch.autograd.Function):
    """warp-ctc's binding: a summed cross entropy whose gradient is computed in the forward and returned by the
    backward as is, whatever ``grad_output`` is (exact only where the upstream gradient is exactly 1)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor) -> Tensor:
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_()
            costs = F.cross_entropy(leaf, targets, reduction="sum")
            (grad,) = torch.autograd.grad(costs, leaf)
        ctx.save_for_backward(grad)
        return costs.detach()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None]:
        (grad,) = ctx.saved_tensors
        return grad, None  # the bug: ``grad * grad_output`` is the chain rule


class ScaledGradient(torch.autograd.Function):
    """The same loss with the chain rule applied: the fixed binding."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor) -> Tensor:
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_()
            costs = F.cross_entropy(leaf, targets, reduction="sum")
            (grad,) = torch.autograd.grad(costs, leaf)
        ctx.save_for_backward(grad)
        return costs.detach()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None]:
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None


class SequenceLoss(nn.Module):
    """The loss module the binding is called through (``warpctc_pytorch.CTCLoss``)."""

    def __init__(self, buggy: bool) -> None:
        super().__init__()
        self.function = ForwardComputedGradient if buggy else ScaledGradient

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        return self.function.apply(logits, targets)


class MultitaskModel(nn.Module):
    """A classifier whose logits feed a plain cross entropy and the binding's loss (multitask learning)."""

    def __init__(self, buggy: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))
        self.sequence_loss = SequenceLoss(buggy)

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


def multitask_batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=generator), torch.randint(0, 5, (8,), generator=generator)


def weighted_loss(model: MultitaskModel, batch: tuple[Tensor, Tensor]) -> Tensor:
    """The binding's loss weighted 0.5 in a mean of two losses: its upstream gradient is 0.5."""
    x, y = batch
    logits = model(x)
    return (F.cross_entropy(logits, y, reduction="sum") + model.sequence_loss(logits, y)) / 2


def unweighted_loss(model: MultitaskModel, batch: tuple[Tensor, Tensor]) -> Tensor:
    """The binding's loss as the last operation: its upstream gradient is exactly 1, training's gradient is right."""
    x, y = batch
    return model.sequence_loss(model(x), y)


def quaternion_where_sqrt(axis_angle: Tensor) -> Tensor:
    """kornia's ``axis_angle_to_quaternion`` before the fix: ``sqrt`` of the squared angle outside the ``where``, so
    at the identity (angle 0) the branch not taken divides by ``sqrt(0)`` and back-propagates NaN."""
    theta2 = (axis_angle * axis_angle).sum(-1, keepdim=True)
    theta = torch.sqrt(theta2)
    small = theta2 < 1e-12
    half = torch.where(small, 0.5 - theta2 / 48.0, torch.sin(theta / 2) / theta)
    w = torch.where(small, 1.0 - theta2 / 8.0, torch.cos(theta / 2))
    return torch.cat([w, axis_angle * half], -1)


def quaternion_safe_sqrt(axis_angle: Tensor) -> Tensor:
    """The fixed formula: the ``sqrt`` of a safe value chosen inside the ``where``, finite in both branches."""
    theta2 = (axis_angle * axis_angle).sum(-1, keepdim=True)
    small = theta2 < 1e-12
    theta = torch.sqrt(torch.where(small, torch.ones_like(theta2), theta2))
    half = torch.where(small, 0.5 - theta2 / 48.0, torch.sin(theta / 2) / theta)
    w = torch.where(small, 1.0 - theta2 / 8.0, torch.cos(theta / 2))
    return torch.cat([w, axis_angle * half], -1)


class Rotation(nn.Module):
    """Rotates point clouds by learnt axis-angle rotations, initialised at the identity (the common start)."""

    def __init__(self, fixed: bool, rotations: int = 4) -> None:
        super().__init__()
        self.convert = quaternion_safe_sqrt if fixed else quaternion_where_sqrt
        self.axis_angle = nn.Parameter(torch.zeros(rotations, 3))

    def forward(self, points: Tensor) -> Tensor:
        q = self.convert(self.axis_angle)
        w, xyz = q[:, None, :1], q[:, None, 1:].expand_as(points)
        t = 2 * torch.cross(xyz, points, dim=-1)
        return points + w * t + torch.cross(xyz, t, dim=-1)


class PosedModel(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.pose = Rotation(fixed)
        self.head = nn.Linear(3, 3)

    def forward(self, points: Tensor) -> Tensor:
        return self.head(self.pose(points))


def points_batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(4, 5, 3, generator=generator), torch.randn(4, 5, 3, generator=generator)


def regression_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


class Probabilities(nn.Module):
    def forward(self, logits: Tensor) -> Tensor:
        return torch.softmax(logits, -1)


class InPlaceScore(nn.Module):
    """The negative log-likelihood of the targets' probabilities; the buggy one then reuses its input's storage for a
    value of its own through ``.data`` (as Liger's kernel stores its gradient into its input), which the softmax saved
    for its backward: the version counter is not bumped, so autograd cannot tell."""

    def __init__(self, buggy: bool) -> None:
        super().__init__()
        self.buggy = buggy

    def forward(self, probabilities: Tensor, targets: Tensor) -> Tensor:
        loss = -probabilities.gather(1, targets[:, None]).log().mean()
        if self.buggy:
            probabilities.data.mul_(0.5)
        return loss


class SoftmaxClassifier(nn.Module):
    def __init__(self, buggy: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))
        self.probabilities = Probabilities()
        self.score = InPlaceScore(buggy)

    def forward(self, x: Tensor, targets: Tensor) -> Tensor:
        return self.score(self.probabilities(self.body(x)), targets)


def scored_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return model(*batch)


class ScaledConvWeightGradient(torch.autograd.Function):
    """A hand-written convolution whose weight gradient is ``factor`` times the true one (a custom kernel's bug)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, factor: float) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.factor = factor
        return F.conv2d(x, weight, padding=1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight = ctx.saved_tensors
        grad_x = torch.nn.grad.conv2d_input(x.shape, weight, grad, padding=1)
        grad_w = torch.nn.grad.conv2d_weight(x, weight.shape, grad, padding=1)
        return grad_x, grad_w * ctx.factor, None


class ZeroInitBlock(nn.Module):
    """A basic residual block whose last BatchNorm starts at weight 0 (timm's ``zero_init_last``): the branch adds
    exactly 0."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        nn.init.zeros_(self.bn2.weight)

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ZeroInitResNet(nn.Module):
    """A stem and two zero-initialised blocks: the blocks' inputs are ReLU outputs with exact zeros, which the blocks'
    last ReLU sees again unchanged, so their inputs are exact ties at initialisation. ``bug``: the stem convolution's
    weight gradient ``bug`` times the true one."""

    def __init__(self, bug: float | None = None, channels: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.blocks = nn.Sequential(ZeroInitBlock(channels), ZeroInitBlock(channels))
        self.fc = nn.Linear(channels, classes)
        self.bug = bug

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x) if self.bug is None else ScaledConvWeightGradient.apply(x, self.stem.weight, self.bug)
        x = F.relu(self.bn(x))
        return self.fc(self.blocks(x).mean((2, 3)))


def image_batches(count: int, size: int = 8) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 3, 8, 8, generator=generator), torch.randint(0, 5, (size,), generator=generator))
            for _ in range(count)]  # fmt: skip


def classification_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


_LIBRARY = torch.library.Library("gradwatch_public_bugs", "DEF")
_LIBRARY.define("halve_(Tensor(a!) x) -> Tensor(a!)")


def _halve_in_place(x: Tensor) -> Tensor:
    """The kernel of ``halve_``: an in-place write out of autograd's sight, as a collective's (``c10d::allreduce_``)."""
    with torch.no_grad():
        x.mul_(0.5)
    return x


_LIBRARY.impl("halve_", _halve_in_place, "CPU")
"""A custom in-place operator registered with a CPU kernel and no autograd kernel, as ``c10d::allreduce_`` is:
autograd backpropagates through it as the identity, with PyTorch's warning, so the gradient of a loss it halves is
twice the derivative (in one process ``all_reduce`` is the identity, and so right)."""


def loss_through_unregistered_operator(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return torch.ops.gradwatch_public_bugs.halve_(F.mse_loss(model(x), y, reduction="sum"))


def all_reduced_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """ms-swift's loss before PR#9947: a plain ``all_reduce`` of the loss (no autograd kernel)."""
    x, y = batch
    loss = F.mse_loss(model(x), y)
    torch.distributed.all_reduce(loss)
    return loss


def regression_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def regression_batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(2)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)


class ScaledLinearWeightGradient(torch.autograd.Function):
    """``x @ weight.T + bias`` with a hand-written backward whose weight gradient is ``factor`` times the true one."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, factor: float) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.factor = factor
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x * ctx.factor, grad.sum(0), None


class BuggyLinear(nn.Linear):
    def __init__(self, features: int, out: int, bug: float) -> None:
        super().__init__(features, out)
        self.bug = bug

    def forward(self, x: Tensor) -> Tensor:
        return ScaledLinearWeightGradient.apply(x, self.weight, self.bias, self.bug)


class SharedNormNet(nn.Module):
    """One BatchNorm called twice in train mode (its second call updates the running statistics its first call's
    backward saved: in place, legitimately) around a linear whose weight gradient is ``bug`` times the true one."""

    def __init__(self, bug: float = 1.05) -> None:
        super().__init__()
        self.inner = BuggyLinear(6, 6, bug)
        self.norm = nn.BatchNorm1d(6)
        self.outer = nn.Linear(6, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.outer(self.norm(torch.tanh(self.inner(self.norm(x)))))
