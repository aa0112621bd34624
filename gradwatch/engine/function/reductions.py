"""Float64 accumulation of the final reductions of a loss, for the perturbed evaluations of a check.

A loss that sums 10^4 float32 terms is rounded to float32 at the end: ``ε·|L|`` of noise in every evaluation, which is
what makes naive float32 gradient checks report 10-100% errors on correct models. Finite differences only need the
terms a perturbation changes; the others cancel exactly if the sum is accumulated in float64. While
:class:`Float64Reductions` is active, a full ``sum``/``mean`` of a low-precision floating tensor, and the
``"sum"``/``"mean"`` reduction of torch's loss functions, sum the same elementwise terms (the model's, in its dtype) in
float64 and return float64 scalars: the model's loss, only rounded less. A loss's ``"mean"`` is easy to get subtly wrong
(torch divides by the element count for some losses, by the sum of weights for others), so the first evaluation of
each check also computes every intercepted call natively, and a disagreement beyond rounding turns the mode off for
that check.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gradwatch.engine.function.modes import OperationMode

# (elementwise terms, denominator) for a loss call; the denominator is None for a plain sum.
_Terms = tuple[Tensor, Tensor | float | None]
_Rule = Callable[[Callable[..., Tensor], tuple[Any, ...], dict[str, Any]], "_Terms | None"]

_LEGACY_REDUCTION_ARGS = ("size_average", "reduce")


def _needs_precision(tensor: object) -> bool:
    return isinstance(tensor, Tensor) and tensor.is_floating_point() and tensor.dtype != torch.float64


def _full_reduction(func: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Terms | None:
    """``x.sum()`` / ``x.mean()`` / ``torch.sum(x)`` / ``torch.mean(x)`` over every element, without a dtype."""
    if len(args) != 1 or kwargs or not _needs_precision(args[0]):
        return None
    tensor = args[0]
    return tensor, float(tensor.numel()) if func in (torch.mean, Tensor.mean) else None


def _loss_terms(
    func: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Tensor, str] | None:
    """Call a torch loss with ``reduction="none"``; returns the terms and the reduction that was asked for."""
    call = dict(kwargs)
    if any(call.get(name) is not None for name in _LEGACY_REDUCTION_ARGS):
        return None
    reduction = call.get("reduction", "mean")
    if not args or not _needs_precision(args[0]) or reduction not in ("mean", "sum", "batchmean"):
        return None
    call["reduction"] = "none"
    return func(*args, **call), reduction


def _elementwise_loss(func: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Terms | None:
    """Losses whose ``"mean"`` is the mean of the unreduced terms (no weight argument involved)."""
    if kwargs.get("weight") is not None:  # mse/l1 divide by Σweight, huber by the count: leave them native
        return None
    found = _loss_terms(func, args, kwargs)
    if found is None or found[1] == "batchmean":
        return None
    terms, reduction = found
    return terms, float(terms.numel()) if reduction == "mean" else None


def _kl_div(func: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Terms | None:
    found = _loss_terms(func, args, kwargs)
    if found is None:
        return None
    terms, reduction = found
    denominators = {
        "sum": None,
        "mean": float(terms.numel()),
        "batchmean": float(args[0].size(0)) if terms.dim() else 1.0,
    }
    return terms, denominators[reduction]


def _class_loss(func: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Terms | None:
    """``cross_entropy`` and ``nll_loss``: the ``"mean"`` is weighted by the classes of the non-ignored targets."""
    found = _loss_terms(func, args, kwargs)
    if found is None or found[1] == "batchmean" or len(args) < 2:
        return None
    terms, reduction = found
    if reduction == "sum":
        return terms, None
    target = args[1]
    if target.is_floating_point():  # class probabilities: mean over the batch elements
        return terms, float(terms.numel())
    weight = kwargs.get("weight")
    if weight is not None and kwargs.get("label_smoothing", 0.0):
        return None
    valid = target != kwargs.get("ignore_index", -100)
    if weight is None:
        return terms, valid.sum().to(torch.float64)
    return terms, weight.to(torch.float64)[target[valid]].sum()


_RULES: dict[Callable[..., Any], _Rule] = {
    **dict.fromkeys((torch.sum, Tensor.sum, torch.mean, Tensor.mean), _full_reduction),
    **dict.fromkeys((
        F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy,
        F.binary_cross_entropy_with_logits, F.soft_margin_loss, F.poisson_nll_loss, F.gaussian_nll_loss,
    ), _elementwise_loss),
    F.kl_div: _kl_div, F.cross_entropy: _class_loss, F.nll_loss: _class_loss,
}  # fmt: skip


def _reduce(terms: Tensor, denominator: Tensor | float | None) -> Tensor:
    total = terms.sum(dtype=torch.float64)
    return total if denominator is None else total / denominator


class Float64Reductions(OperationMode):
    """Accumulates full reductions and loss reductions in float64 (see the module doc); with ``verify``, also computes
    every intercepted call natively: on a disagreement beyond the native rounding of the sum, the native result is
    used and :attr:`mismatch` describes the call."""

    def __init__(self, verify: bool = False) -> None:
        super().__init__()
        self.verify = verify
        self.mismatch: str | None = None

    def operation(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rule = _RULES.get(func)
        found = rule(func, args, kwargs) if rule is not None else None
        if found is None:
            return func(*args, **kwargs)
        terms, denominator = found
        precise = _reduce(terms, denominator)
        if not self.verify:
            return precise
        native = func(*args, **kwargs)
        if not self._agrees(native, precise, terms, denominator):
            self.mismatch = (
                f"{getattr(func, '__name__', func)}: float64 reduction {precise.item():.9g} differs from the native "
                f"{native.item():.9g}"
            )
            return native
        return precise

    @staticmethod
    def _agrees(native: Tensor, precise: Tensor, terms: Tensor, denominator: Tensor | float | None) -> bool:
        """Whether ``native`` is ``precise`` up to the rounding of a (blocked) sum in the native dtype."""
        if native.shape != precise.shape or not torch.isfinite(native) or not torch.isfinite(precise):
            return bool(native.shape == precise.shape and torch.equal(native.double(), precise))
        magnitude = terms.abs().sum(dtype=torch.float64).item()
        if denominator is not None:
            magnitude /= float(denominator)
        epsilon = torch.finfo(terms.dtype).eps
        tolerance = 4 * epsilon * (math.log2(terms.numel() + 1) + 4) * magnitude
        return abs(native.item() - precise.item()) <= tolerance
