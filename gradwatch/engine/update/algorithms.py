"""The update rules of the optimizers gradwatch has a reference for, one pure function each: ``rule(param, grad,
state, hyper, precise=..., dtype=...) -> new param``.

Each computes, out of place, what one step of the optimizer makes of one parameter from its value, the gradient it steps
with, its state before the step (a missing entry is the state the optimizer would create at its first step) and its
param group's hyperparameters. The arithmetic follows the inputs' dtype: float64 inputs give the reference update,
inputs in the optimizer's own dtypes give the same rule rounded as the optimizer rounds (the check's floor,
:mod:`gradwatch.engine.update.check`). ``precise`` says which of the two is asked for, for the rules that choose a
precision of their own (Muon's Newton-Schulz iteration runs in bfloat16); ``dtype`` is the parameter's own dtype, for
the rules whose defaults depend on it (Adafactor's ``eps1``).

The rules are written from torch's single-tensor implementations (``torch/optim/sgd.py``, ``adam.py``, ``rmsprop.py``,
``_adafactor.py`` in torch 2.13), operation for operation where the rounding matters; the foreach and fused variants
compute the same update and are checked against the same rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["UpdateRule", "adafactor", "adam", "rmsprop", "scalar", "sgd"]


class UpdateRule(Protocol):
    """One optimizer's step of one parameter, out of place (see the module doc)."""

    def __call__(
        self, param: Tensor, grad: Tensor, state: Mapping[str, Any], hyper: Mapping[str, Any], *, precise: bool,
        dtype: torch.dtype,
    ) -> Tensor: ...  # fmt: skip


def scalar(value: Any) -> float:
    """A hyperparameter or a step count as a float (a one-element tensor learning rate or ``step``, a number)."""
    return float(value.item()) if isinstance(value, Tensor) else float(value)


def _steps(state: Mapping[str, Any]) -> float:
    """The step count after this step: the kept ``step`` (a tensor or an int) plus one, 1 at the first step."""
    kept = state.get("step")
    return (scalar(kept) if kept is not None else 0.0) + 1.0


def _zeros(grad: Tensor, state: Mapping[str, Any], key: str) -> Tensor:
    kept = state.get(key)
    return kept if isinstance(kept, Tensor) else torch.zeros_like(grad)


def sgd(
    param: Tensor, grad: Tensor, state: Mapping[str, Any], hyper: Mapping[str, Any], *, precise: bool,
    dtype: torch.dtype,
) -> Tensor:  # fmt: skip
    """``torch.optim.SGD``: weight decay (added to the gradient), momentum with dampening, Nesterov, ``maximize``."""
    lr, weight_decay = scalar(hyper["lr"]), scalar(hyper.get("weight_decay", 0.0))
    momentum, dampening = scalar(hyper.get("momentum", 0.0)), scalar(hyper.get("dampening", 0.0))
    g = -grad if hyper.get("maximize", False) else grad
    if weight_decay != 0:
        g = g.add(param, alpha=weight_decay)
    if momentum != 0:
        kept = state.get("momentum_buffer")
        buf = g.clone() if not isinstance(kept, Tensor) else kept.mul(momentum).add(g, alpha=1 - dampening)
        g = g.add(buf, alpha=momentum) if hyper.get("nesterov", False) else buf
    return param.add(g, alpha=-lr)


def adam(
    param: Tensor, grad: Tensor, state: Mapping[str, Any], hyper: Mapping[str, Any], *, precise: bool,
    dtype: torch.dtype,
) -> Tensor:  # fmt: skip
    """``torch.optim.Adam`` and ``AdamW``: L2 or decoupled weight decay (``decoupled_weight_decay``), ``amsgrad``,
    ``maximize``, bias correction (unless the group says ``bias_correction=False``, as DeepSpeed's Adams may)."""
    lr, weight_decay, eps = scalar(hyper["lr"]), scalar(hyper.get("weight_decay", 0.0)), scalar(hyper["eps"])
    beta1, beta2 = (scalar(b) for b in hyper["betas"])
    step = _steps(state)
    g = -grad if hyper.get("maximize", False) else grad
    p = param
    if weight_decay != 0:
        p = p.mul(1 - lr * weight_decay) if hyper.get("decoupled_weight_decay", False) else p
        g = g if hyper.get("decoupled_weight_decay", False) else g.add(param, alpha=weight_decay)
    exp_avg = _zeros(g, state, "exp_avg").lerp(g, 1 - beta1)
    exp_avg_sq = _zeros(g, state, "exp_avg_sq").mul(beta2).addcmul(g, g, value=1 - beta2)
    corrected = hyper.get("bias_correction", True)
    bias_correction1 = 1 - beta1**step if corrected else 1.0
    bias_correction2 = 1 - beta2**step if corrected else 1.0
    second = exp_avg_sq
    if hyper.get("amsgrad", False):
        second = torch.maximum(_zeros(g, state, "max_exp_avg_sq"), exp_avg_sq)
    denom = (second.sqrt() / bias_correction2**0.5).add(eps)
    return p.addcdiv(exp_avg, denom, value=-(lr / bias_correction1))


def rmsprop(
    param: Tensor, grad: Tensor, state: Mapping[str, Any], hyper: Mapping[str, Any], *, precise: bool,
    dtype: torch.dtype,
) -> Tensor:  # fmt: skip
    """``torch.optim.RMSprop``: weight decay, ``centered``, momentum, ``maximize``."""
    lr, alpha, eps = scalar(hyper["lr"]), scalar(hyper["alpha"]), scalar(hyper["eps"])
    weight_decay, momentum = scalar(hyper.get("weight_decay", 0.0)), scalar(hyper.get("momentum", 0.0))
    g = -grad if hyper.get("maximize", False) else grad
    if weight_decay != 0:
        g = g.add(param, alpha=weight_decay)
    square_avg = _zeros(g, state, "square_avg").mul(alpha).addcmul(g, g, value=1 - alpha)
    if hyper.get("centered", False):
        grad_avg = _zeros(g, state, "grad_avg").lerp(g, 1 - alpha)
        avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt()
    else:
        avg = square_avg.sqrt()
    avg = avg.add(eps)
    if momentum > 0:
        buf = _zeros(g, state, "momentum_buffer").mul(momentum).addcdiv(g, avg)
        return param.add(buf, alpha=-lr)
    return param.addcdiv(g, avg, value=-lr)


def adafactor(
    param: Tensor, grad: Tensor, state: Mapping[str, Any], hyper: Mapping[str, Any], *, precise: bool,
    dtype: torch.dtype,
) -> Tensor:  # fmt: skip
    """``torch.optim.Adafactor``: factored second moments for a matrix (row and column variances), a full one for a
    vector, the relative step ``min(lr, 1/√t)`` scaled by the parameter's RMS, the update clipped by ``d``."""
    lr, d, weight_decay = scalar(hyper["lr"]), scalar(hyper.get("d", 1.0)), scalar(hyper.get("weight_decay", 0.0))
    beta2_decay = scalar(hyper.get("beta2_decay", -0.8))
    eps1_given, eps2 = hyper.get("eps", (None, 1e-3))
    eps1 = torch.finfo(dtype).eps if eps1_given is None else scalar(eps1_given)
    g = -grad if hyper.get("maximize", False) else grad
    step = _steps(state)
    one_minus_beta2 = step**beta2_decay
    rho = min(lr, 1 / step**0.5)
    alpha = max(scalar(eps2), float(param.norm(2)) / param.numel() ** 0.5) * rho
    p = param.mul(1 - lr * weight_decay) if weight_decay != 0 else param
    if g.dim() > 1:
        row_shape, col_shape = list(g.shape), list(g.shape)
        row_shape[-1], col_shape[-2] = 1, 1
        row_kept, col_kept = state.get("row_var"), state.get("col_var")
        row_var = row_kept if isinstance(row_kept, Tensor) else g.new_zeros(row_shape)
        col_var = col_kept if isinstance(col_kept, Tensor) else g.new_zeros(col_shape)
        row_var = row_var.lerp(torch.norm(g, dim=-1, keepdim=True).square().div(g.size(-1)), one_minus_beta2)
        col_var = col_var.lerp(torch.norm(g, dim=-2, keepdim=True).square().div(g.size(-2)), one_minus_beta2)
        estimate = (row_var @ col_var).div(row_var.mean(dim=-2, keepdim=True).clamp(min=eps1))
    else:
        estimate = _zeros(g, state, "variance").lerp(g * g, one_minus_beta2)
    update = estimate.clamp(min=eps1 * eps1).rsqrt().mul(g)
    denom = max(1.0, float(update.norm(2)) / (math.sqrt(update.numel()) * d))
    return p.add(update, alpha=-alpha / denom)
