"""The precision probes evaluate the loss in: the model's own dtype, or float64.

Finite differences lose about half the digits of the dtype they are computed in. In float32 a well-chosen probe
still resolves relative errors of ~1e-5, but a 16-bit model (``precision="bf16-true"``) leaves ~1e-2 at best, far
from a 1% error. Evaluating the perturbed losses in float64 removes the numerical noise almost entirely, at the price
of float64 kernels (about 2x slower on CPUs and data-centre GPUs, far slower on consumer GPUs; a few operations have no
float64 kernel at all) and of a float64 copy of the parameters and buffers during the check.

``precision="auto"`` pays that price only where it buys something: 16-bit models are probed in float64 throughout,
float32 models natively, with the few probes whose native stencils could not decide (a discrepancy beyond the tolerance
that round-off or kinks kept from being resolved) measured again in float64.

The analytic gradient is never taken from the float64 version: it is the gradient training uses, computed in the
model's own dtype, with its hooks. Only the finite differences move to float64.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module

Precision = Literal["auto", "native", "float64"]
"""``"native"``: probes evaluate the loss in the parameters' own dtype. ``"float64"``: in float64, on float64 copies
of the parameters, buffers and floating inputs. ``"auto"``: float64 for 16-bit parameters (whose own finite
differences cannot resolve a 1% error); native otherwise, with undecided probes measured again in float64."""

PRECISIONS: tuple[Precision, ...] = ("auto", "native", "float64")

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def resolve_precision(precision: Precision, parameter_dtype: torch.dtype) -> Literal["native", "float64"]:
    """What ``precision`` means for parameters of ``parameter_dtype``."""
    if precision == "auto":
        return "float64" if parameter_dtype in _SIXTEEN_BIT else "native"
    if precision == "float64" and parameter_dtype == torch.float64:
        return "native"
    return precision


@contextlib.contextmanager
def float64_storage(model: nn.Module) -> Iterator[dict[int, Tensor]]:
    """Evaluate ``model`` on float64 copies of its floating parameters and buffers, then put everything back.

    Parameters are substituted, not converted: the module sees float64 tensors in their place for the duration, while
    the ``Parameter`` objects, their ``.grad``, their hooks and the gradient accumulators that DDP and optimizers hook
    into are never touched (changing a parameter's dtype in place would reset its accumulator and silently unhook
    DDP's gradient reduction). Buffers, which have no accumulator, get float64 storage and their own back afterwards.

    Yields:
        The float64 substitute of each parameter, keyed by ``id(parameter)``: probes perturb those.
    """
    substitutes: dict[str, Tensor] = {}
    by_identity: dict[int, Tensor] = {}
    for name, parameter in model.named_parameters():
        if parameter.is_floating_point() and parameter.dtype != torch.float64:
            substitutes[name] = parameter.detach().to(torch.float64)
            by_identity[id(parameter)] = substitutes[name]
    saved: list[tuple[Tensor, Tensor]] = []
    try:
        with torch.no_grad():
            for buffer in model.buffers():
                if buffer.is_floating_point() and buffer.dtype != torch.float64:
                    saved.append((buffer, buffer.data))
                    buffer.data = buffer.data.to(torch.float64)
        with _reparametrize_module(model, substitutes, tie_weights=True, strict=False):
            yield by_identity
    finally:
        for buffer, original in reversed(saved):
            buffer.data = original
