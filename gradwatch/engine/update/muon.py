"""Muon's update rules: ``torch.optim.Muon`` (torch 2.13) and Muon as written in Keller Jordan's reference
(``KellerJordan/Muon``'s ``muon.py``: ``Muon``, ``SingleDeviceMuon`` and the groups of ``MuonWithAuxAdam``).

Muon's update is a function of the whole matrix: the momentum (Nesterov by default) is orthogonalised by a quintic
Newton-Schulz iteration, then scaled by the learning rate adjusted to the matrix's shape. An implementation that
orthogonalises the blocks of a matrix a tensor-parallel rank holds instead of the whole (DeepSpeed#8437), or skips the
iteration (plain SGD with momentum), makes a gradient check pass and the update wrong: what the update check sees.

Both implementations run the iteration in bfloat16: the reference runs it in float64 (``precise=True``), the floor of
the check's tolerance runs it in bfloat16 as the optimizer does (``precise=False``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gradwatch.engine.update.algorithms import adam, scalar

__all__ = ["FLOOR_VARIANTS", "KELLER_COEFFICIENTS", "keller_aux_adam", "keller_muon", "newton_schulz", "torch_muon"]

KELLER_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic iteration's coefficients ``(a, b, c)`` in Keller Jordan's post, torch's defaults too."""

ELEMENTWISE = "gradwatch_elementwise_newton_schulz"
"""A key the floor's re-runs add to a Muon group's hyperparameters: the bfloat16 iteration in one implementation's
order of operations or the other's (:data:`FLOOR_VARIANTS`), since they round apart and either may be the
optimizer's."""

FLOOR_VARIANTS = ({ELEMENTWISE: False}, {ELEMENTWISE: True})
"""The re-runs of a Muon rule whose largest distance from the reference is the floor."""

KELLER_STEPS = 5
"""The iterations Keller Jordan's ``muon_update`` runs (its ``ns_steps`` default)."""


def newton_schulz(
    matrix: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, *, precise: bool,
    additive_eps: bool = False, elementwise: bool = False,
) -> Tensor:  # fmt: skip
    """``matrix`` orthogonalised by ``steps`` quintic Newton-Schulz iterations ``X ← aX + (bA + cA²)X``, ``A = XXᵀ``,
    on the wide orientation, after normalising by the Frobenius norm (clamped at ``eps``, torch; plus ``eps``, Keller
    Jordan's, ``additive_eps``); in float64 when ``precise``, else in bfloat16 as both implementations run it, with
    torch's fused ``addmm`` or, ``elementwise``, Keller Jordan's separate products and sums (they round apart)."""
    a, b, c = (float(x) for x in coefficients)
    x = matrix.to(torch.float64 if precise else torch.bfloat16)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    norm = x.norm(dim=(-2, -1), keepdim=True)
    x = x / (norm + eps if additive_eps else norm.clamp(min=eps))
    for _ in range(int(steps)):
        gram = x @ x.mT
        if x.dim() == 2 and not elementwise:
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        else:
            x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def _adjusted_lr(lr: float, adjust: str | None, shape: torch.Size) -> float:
    """torch's ``_adjust_lr``: ``√max(1, A/B)`` (``"original"``, Keller Jordan's), ``0.2 √max(A, B)``
    (``"match_rms_adamw"``, Moonshot's)."""
    rows, cols = shape[0], shape[1]
    if adjust is None or adjust == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _momentum(grad: Tensor, state: Mapping[str, Any], momentum: float, nesterov: bool) -> Tensor:
    kept = state.get("momentum_buffer")
    buf = (kept if isinstance(kept, Tensor) else torch.zeros_like(grad)).lerp(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def torch_muon(
    param: Tensor, grad: Tensor, state: Mapping[str, Any], hyper: Mapping[str, Any], *, precise: bool,
    dtype: torch.dtype,
) -> Tensor:  # fmt: skip
    """``torch.optim.Muon``: momentum (``nesterov``), Newton-Schulz with the group's ``ns_coefficients``, ``ns_steps``
    and ``eps``, decoupled weight decay, the learning rate adjusted by ``adjust_lr_fn``."""
    lr, weight_decay = scalar(hyper["lr"]), scalar(hyper.get("weight_decay", 0.0))
    update = _momentum(grad, state, scalar(hyper["momentum"]), bool(hyper.get("nesterov", True)))
    update = newton_schulz(
        update, hyper.get("ns_coefficients", KELLER_COEFFICIENTS), hyper.get("ns_steps", KELLER_STEPS),
        scalar(hyper.get("eps", 1e-7)), precise=precise, elementwise=bool(hyper.get(ELEMENTWISE, False)),
    )  # fmt: skip
    adjusted = _adjusted_lr(lr, hyper.get("adjust_lr_fn"), param.shape)
    return param.mul(1 - lr * weight_decay).add(update.to(param.dtype) if precise else update, alpha=-adjusted)


def keller_muon(
    param: Tensor, grad: Tensor, state: Mapping[str, Any], hyper: Mapping[str, Any], *, precise: bool,
    dtype: torch.dtype,
) -> Tensor:  # fmt: skip
    """Keller Jordan's ``muon_update``: Nesterov momentum (``beta`` the group's ``momentum``), a 4-D filter as a
    matrix of its first dimension, 5 iterations normalised by ``‖X‖ + 1e-7``, scaled by ``√max(1, rows/cols)``, then
    decoupled weight decay and ``lr``. Groups may name ``ns_steps`` and ``nesterov``, as variants do."""
    lr, weight_decay = scalar(hyper["lr"]), scalar(hyper.get("weight_decay", 0.0))
    update = _momentum(grad, state, scalar(hyper.get("momentum", 0.95)), bool(hyper.get("nesterov", True)))
    if update.dim() == 4:
        update = update.reshape(len(update), -1)
    update = newton_schulz(
        update,
        KELLER_COEFFICIENTS,
        hyper.get("ns_steps", KELLER_STEPS),
        1e-7,
        precise=precise,
        additive_eps=True,
        elementwise=bool(hyper.get(ELEMENTWISE, True)),
    )
    update = update * max(1.0, update.size(-2) / update.size(-1)) ** 0.5
    step = update.reshape(param.shape)
    return param.mul(1 - lr * weight_decay).add(step.to(param.dtype) if precise else step, alpha=-lr)


def keller_aux_adam(
    param: Tensor, grad: Tensor, state: Mapping[str, Any], hyper: Mapping[str, Any], *, precise: bool,
    dtype: torch.dtype,
) -> Tensor:  # fmt: skip
    """The Adam of ``MuonWithAuxAdam``'s ``use_muon=False`` groups: bias-corrected moments, ``eps`` added to the
    corrected root, decoupled weight decay: AdamW's rule (its ``step`` an int in the state)."""
    settings = {"betas": (0.9, 0.95), "eps": 1e-10, **hyper, "decoupled_weight_decay": True, "amsgrad": False}
    return adam(param, grad, state, settings, precise=precise, dtype=dtype)
