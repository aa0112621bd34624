"""Optimizers whose update is wrong in the ways seen in public in 2026 (for the update check's tests), and a small
model and loop to train them on."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from gradwatch import GradientWatch


def mlp(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def batch(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(32, 8, dtype=dtype), torch.randn(32, 4, dtype=dtype)


def loss_fn(model: nn.Module, item: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(item[0]), item[1])


def watched_loop(
    make: Callable[[nn.Module], torch.optim.Optimizer],
    steps: int,
    *,
    sinks: Sequence[Any] = (),
    recomputed: bool = False,
) -> GradientWatch:
    """``steps`` steps of :func:`mlp` stepped by ``make(model)`` through ``GradientWatch``: an applied and an update
    check at each (failures kept, not raised), the recomputed check of ``maybe_check`` too where ``recomputed``."""
    watch = GradientWatch(
        every_n_steps=1000, first_check_step=1, applied_every_n_steps=1, max_overhead=None, verbose=False,
        on_fail=lambda report: None, sinks=list(sinks),
    )  # fmt: skip
    model = mlp()
    optimizer = make(model)
    torch.manual_seed(1)
    for step in range(1, steps + 1):
        item = batch()
        watch.record(item)
        model.zero_grad()
        loss_fn(model, item).backward()
        watch.before_optimizer_step(model, loss_fn, step=step, optimizer=optimizer)
        optimizer.step()
        if recomputed:
            watch.maybe_check(model, item, loss_fn, step=step)
    watch.flush()
    return watch


def _closure(closure: Callable[[], float] | None) -> None:
    """Run a step's closure as torch's optimizers do (Lightning passes its training step as one)."""
    if closure is not None:
        with torch.enable_grad():
            closure()


class _StepMuon(torch.optim.Muon):
    """torch's Muon with its orthogonalisation replaced (``_orthogonalised``)."""

    def _orthogonalised(self, update: torch.Tensor, group: dict) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        _closure(closure)
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = self._orthogonalised(update, group)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))


class RowShardedMuon(_StepMuon):
    """Muon orthogonalising the two row blocks of each matrix apart, as two tensor-parallel shards would
    (DeepSpeed#8437)."""

    def _orthogonalised(self, update: torch.Tensor, group: dict) -> torch.Tensor:
        blocks = update.chunk(2, dim=0)
        args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        return torch.cat([_zeropower_via_newtonschulz(b, *args) for b in blocks], dim=0)


class NoNewtonSchulzMuon(_StepMuon):
    """Muon that runs no Newton-Schulz iteration: SGD with Nesterov momentum (DeepSpeed PR#8442)."""

    def _orthogonalised(self, update: torch.Tensor, group: dict) -> torch.Tensor:
        return update


class TwiceDecayedAdamW(torch.optim.AdamW):
    """AdamW applying its decoupled weight decay twice: once itself, once in torch's step."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        _closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
        super().step()


class LateBiasCorrectionAdam(torch.optim.Adam):
    """Adam whose bias correction uses the step before (``t − 1``, at least 1)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        _closure(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                late = max(float(state["step"]) - 1, 1.0)
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (state["exp_avg_sq"].sqrt() / (1 - beta2**late) ** 0.5).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**late))


class StaleGradientSGD(torch.optim.SGD):
    """SGD that steps with the previous step's gradient (a gradient buffer one step behind), its first step with the
    current one."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.previous: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        _closure(closure)
        current = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    current[id(p)] = p.grad.clone()
                    p.grad.copy_(self.previous.get(id(p), p.grad))
        super().step()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.copy_(current[id(p)])
        self.previous = current


class KellerMuon(torch.optim.Optimizer):
    """Muon as written in Keller Jordan's reference (``SingleDeviceMuon``: its group keys ``lr``, ``momentum``,
    ``weight_decay``; Nesterov, 5 iterations in bfloat16, ``‖X‖ + 1e-7``, ``√max(1, rows/cols)``)."""

    def __init__(self, params: object, lr: float = 0.02, weight_decay: float = 0.0, momentum: float = 0.95) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum})  # type: ignore[arg-type]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        _closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                momentum = state["momentum_buffer"]
                momentum.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp_(momentum, group["momentum"])
                x = update.bfloat16()
                if update.size(-2) > update.size(-1):
                    x = x.mT
                x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
                for _ in range(5):
                    a = x @ x.mT
                    x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
                if update.size(-2) > update.size(-1):
                    x = x.mT
                x = x * max(1, p.grad.size(-2) / p.grad.size(-1)) ** 0.5
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(x.reshape(p.shape), alpha=-group["lr"])
