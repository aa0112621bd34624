"""Small models, batches and state snapshots shared by the tests (synthetic data made on the spot)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, TensorDataset

from gradwatch.engine.numerics.stencil import Point, Stencil


class ScaledLinearFunction(torch.autograd.Function):
    """``x @ w.T + b`` with a hand-written backward: the weight gradient is multiplied by ``weight_scale`` and every
    gradient by ``sign`` (1 and 1 are the correct backward)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, weight_scale: float, sign: float) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.weight_scale = weight_scale
        ctx.sign = sign
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        x, weight = ctx.saved_tensors
        grad_weight = ctx.sign * ctx.weight_scale * (grad_output.t() @ x)
        return ctx.sign * (grad_output @ weight), grad_weight, ctx.sign * grad_output.sum(0), None, None


class SeedModel(nn.Module):
    """The forum "seed case": a linear layer through a custom Function, 64 -> 120 features."""

    def __init__(self, weight_scale: float = 1.0, sign: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(64, 120)
        self.weight_scale = weight_scale
        self.sign = sign

    def forward(self, x: Tensor) -> Tensor:
        return ScaledLinearFunction.apply(x, self.fc.weight, self.fc.bias, self.weight_scale, self.sign)


def seed_batch() -> tuple[Tensor, Tensor]:
    """140 samples; the loss is ``MSELoss(reduction="sum")`` over a 140x120 float32 tensor (~2.5e4)."""
    generator = torch.Generator().manual_seed(1)
    return torch.randn(140, 64, generator=generator), torch.randn(140, 120, generator=generator)


def seed_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    inputs, targets = batch
    return nn.MSELoss(reduction="sum")(model(inputs), targets)


class DropoutBatchNormNet(nn.Module):
    def __init__(self, features: int = 16, hidden: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def classification_batch(
    samples: int = 32, features: int = 16, classes: int = 4, seed: int = 2
) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(samples, features, generator=generator), torch.randint(
        0, classes, (samples,), generator=generator
    )


def cross_entropy_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything a check must leave untouched, copied."""
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "param_ids": {n: id(p) for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "grads": {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()},
        "grad_ids": {n: id(p.grad) for n, p in model.named_parameters()},
        "modes": [m.training for m in model.modules()],
        "running_statistics": [m.track_running_stats for m in model.modules() if isinstance(m, _BatchNorm)],
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state()[1].copy(),
    }


def assert_bit_identical(before: dict[str, Any], after: dict[str, Any]) -> None:
    for kind in ("params", "buffers"):
        assert before[kind].keys() == after[kind].keys()
        for name, value in before[kind].items():
            assert torch.equal(value, after[kind][name]), f"{kind} {name} changed"
            assert value.dtype == after[kind][name].dtype
    for name, grad in before["grads"].items():
        other = after["grads"][name]
        assert (grad is None) == (other is None), f".grad of {name} appeared or vanished"
        if grad is not None:
            assert torch.equal(grad, other), f".grad of {name} changed"
    assert before["param_ids"] == after["param_ids"]
    assert before["grad_ids"] == after["grad_ids"], ".grad tensors were replaced"
    assert before["modes"] == after["modes"]
    assert before["running_statistics"] == after["running_statistics"]
    assert torch.equal(before["torch_rng"], after["torch_rng"])
    assert before["python_rng"] == after["python_rng"]
    assert np.array_equal(before["numpy_rng"], after["numpy_rng"])


class LitClassifier(pl.LightningModule):
    """A tiny LightningModule around any ``nn.Module`` classifier, with switches for the callback tests."""

    def __init__(self, net: nn.Module | None = None, lr: float = 0.05) -> None:
        super().__init__()
        self.net = net if net is not None else DropoutBatchNormNet()
        self.lr = lr
        self.output = "tensor"  # "tensor", "dict" or "none"
        self.raise_in_step = False
        self.real_losses: dict[int, float] = {}

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Any:
        if self.raise_in_step:
            raise RuntimeError("training_step failed on purpose")
        loss = cross_entropy_loss(self.net, batch)
        self.log("train_loss", loss)
        if self.output == "none":
            return None
        if self.output == "dict":
            return {"loss": loss, "extra": 1.0}
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if isinstance(outputs, dict) and "loss" in outputs:
            self.real_losses[self.trainer.global_step] = float(outputs["loss"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class LitSeedModel(LitClassifier):
    """The seed case as a LightningModule (``weight_scale`` != 1 plants a bug in the weight gradient)."""

    def __init__(self, weight_scale: float = 1.0) -> None:
        super().__init__(SeedModel(weight_scale))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Any:
        loss = seed_loss(self.net, batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-5)


def loader(batch: tuple[Tensor, Tensor], batches: int = 8) -> DataLoader:
    """``batches`` batches shaped like ``batch`` (fresh synthetic samples, fixed seed)."""
    generator = torch.Generator().manual_seed(3)
    inputs, targets = batch
    size = inputs.shape[0]
    all_inputs = torch.randn(size * batches, *inputs.shape[1:], generator=generator)
    if targets.is_floating_point():
        all_targets = torch.randn(size * batches, *targets.shape[1:], generator=generator)
    else:
        all_targets = torch.randint(0, int(targets.max()) + 1, (size * batches,), generator=generator)
    return DataLoader(TensorDataset(all_inputs, all_targets), batch_size=size)


def trainer(tmp_path: Any, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    """A quiet CPU trainer writing under ``tmp_path``."""
    options: dict[str, Any] = {
        "max_steps": 6,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "default_root_dir": str(tmp_path),
    }
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


def exact_stencil(
    f: Callable[[float], float], analytic: float, step: float, offsets: tuple[float, ...] = (1.0, -1.0, 0.5, -0.5)
) -> Stencil:
    """The stencil of ``f`` around 0 with exact displacements; ``analytic`` plays autograd's derivative."""
    points = tuple(Point(o, f(o * step), o * step, analytic * o * step) for o in offsets)
    return Stencil(step=step, center=f(0.0), analytic=analytic, points=points)


def recomputed_counts(counts: dict[str, int]) -> dict[str, int]:
    """The recomputed checks' counters of ``watch.counts`` (the applied checks' counted beside them)."""
    return {key: counts[key] for key in ("checks", "failed", "skipped", "postponed")}
