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
compute the same update and are checked against the same rule. Which rule a param group is checked against is
recognised by what the optimizer is (:func:`reference_for`): its class name and the keys of its param group (duck
typing), not its inheritance, so that the classes other libraries ship for the same algorithms (a fused Adam, a Muon
with auxiliary Adam groups) are checked against the same rule.

Muon's rules: ``torch.optim.Muon`` (torch 2.13) and Muon as written in Keller Jordan's reference
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
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor


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


ADAMS = {"adam", "adamw"}
"""Class names (lower case) of Adams whose update is torch's Adam or AdamW rule, their step count in the state (a
fused Adam that counts steps per group, as DeepSpeed's do, is replayed instead)."""


@dataclass(frozen=True)
class Reference:
    """The rule a param group's update is checked against.

    Attributes:
        name: What the report names it (``"torch.optim.AdamW"``, ``"Muon (Keller Jordan)"``).
        hyper: The group's hyperparameters as the rule reads them (a decoupled-decay flag made explicit).
        variants: Settings added to ``hyper`` for the floor's re-runs in the optimizer's dtype, the floor the largest
            of their distances from the reference (Muon's two orders of operations); one empty one for the others.
    """

    name: str
    rule: UpdateRule
    hyper: Mapping[str, Any]
    variants: tuple[Mapping[str, Any], ...] = ({},)


def reference_for(optimizer: Any, group: Mapping[str, Any]) -> Reference | None:
    """The reference rule for ``group`` of ``optimizer`` (its hyperparameters, without ``params``), or ``None``: the
    first class of its method resolution order whose name and the group's keys fit a rule (a subclass of ``AdamW`` is
    checked against AdamW's rule: one that changes the update is what the check is for)."""
    hyper = {key: value for key, value in group.items() if key != "params"}
    for klass in type(optimizer).__mro__:
        found = _by_name(optimizer, klass.__name__, type(optimizer).__name__, group, hyper)
        if found is not None:
            return found
    return None


def _by_name(optimizer: Any, kind: str, own: str, group: Mapping[str, Any], hyper: dict[str, Any]) -> Reference | None:
    lower = kind.lower()
    if "muon" in lower:
        if "use_muon" in group and not group["use_muon"]:
            return Reference(f"{own} auxiliary Adam (Keller Jordan's adam_update)", keller_aux_adam, hyper)
        if group.keys() >= {"ns_coefficients", "ns_steps", "momentum", "lr"}:
            return Reference(_named(own, "Muon"), torch_muon, hyper, FLOOR_VARIANTS)
        if group.keys() >= {"lr", "momentum"}:
            return Reference(f"{own} (Keller Jordan's muon_update)", keller_muon, hyper, FLOOR_VARIANTS)
        return None
    if lower in ADAMS and group.keys() >= {"lr", "betas", "eps"}:
        decoupled = group.get("decoupled_weight_decay", lower.endswith("w"))
        return Reference(_named(own, "AdamW" if decoupled else "Adam"), adam,
                         {**hyper, "decoupled_weight_decay": bool(decoupled)})  # fmt: skip
    if lower == "sgd" and group.keys() >= {"lr", "momentum", "dampening", "nesterov", "weight_decay"}:
        return Reference(_named(own, "SGD"), sgd, hyper)
    if lower == "rmsprop" and group.keys() >= {"lr", "alpha", "eps", "centered", "momentum"}:
        return Reference(_named(own, "RMSprop"), rmsprop, hyper)
    if lower == "adafactor" and group.keys() >= {"lr", "beta2_decay", "eps", "d"}:
        return Reference(_named(own, "Adafactor"), adafactor, hyper)
    return None


def _named(kind: str, rule: str) -> str:
    return f"torch.optim.{rule}" if kind == rule else f"{kind} (torch's {rule} rule)"
