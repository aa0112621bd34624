"""Complex parameters, checked as the real tensors they are to the optimiser.

A spectral model (a Fourier neural operator) keeps its core weights complex. For a real loss ``L`` and a complex
parameter ``z = a + ib``, PyTorch's gradient is ``∂L/∂a + i ∂L/∂b``, and the directional derivative along a complex
direction ``v`` is ``Re(Σ conj(grad)·v)``: exactly the real derivative of ``L`` with respect to ``(a, b)``. So a
check probes ``torch.view_as_real(z)``: a real view sharing ``z``'s storage (perturbing it moves ``z``), with
``torch.view_as_real(grad)`` as its gradient. Autograd still differentiates ``z`` itself (:func:`autograd_tensor`),
and a substitution puts a complex tensor in the module's place (:func:`stored_value`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def checked_view(parameter: Tensor) -> Tensor:
    """The real tensor a check perturbs for ``parameter``: ``view_as_real`` of a complex one, else the parameter."""
    return torch.view_as_real(parameter) if parameter.is_complex() else parameter


def is_real_view(tensor: Tensor) -> bool:
    """Whether ``tensor`` is the real view of a complex parameter (see :func:`checked_view`)."""
    base = tensor._base
    return base is not None and base.is_complex()


def autograd_tensor(tensor: Tensor) -> Tensor:
    """What autograd differentiates for a checked tensor: the complex parameter behind a real view, else itself."""
    return tensor._base if is_real_view(tensor) else tensor  # type: ignore[return-value]


def checked_gradient(tensor: Tensor, grad: Tensor | None) -> Tensor | None:
    """Autograd's gradient of :func:`autograd_tensor` as the gradient of the checked tensor (its real view)."""
    if grad is None or not grad.is_complex():
        return grad
    return torch.view_as_real(grad.resolve_conj())


def stored_value(tensor: Tensor, value: Tensor) -> Tensor:
    """``value`` (a real tensor shaped like the checked tensor, with leading dimensions perhaps) as the module must
    hold it: complex for the real view of a complex parameter."""
    return torch.view_as_complex(value.contiguous()) if is_real_view(tensor) else value


def parameter_hooks(tensor: Tensor) -> list[Any]:
    """The ``register_hook`` hooks of a checked tensor's parameter (its complex one's behind a real view)."""
    return list((getattr(autograd_tensor(tensor), "_backward_hooks", None) or {}).values())


def with_parameter_hooks(tensor: Tensor, grad: Tensor) -> Tensor:
    """``grad`` (a checked tensor's, computed on a copy of its parameter: float64 storage) with the parameter's
    ``register_hook`` hooks applied, as autograd applies them (a complex parameter's to its complex gradient)."""
    hooks = parameter_hooks(tensor)
    if not hooks:
        return grad
    complex_view = is_real_view(tensor)
    if complex_view:
        grad = torch.view_as_complex(grad.contiguous())
    for hook in hooks:
        changed = hook(grad)
        grad = changed if changed is not None else grad
    return torch.view_as_real(grad.resolve_conj()) if complex_view else grad
