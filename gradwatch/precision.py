"""The precision probes evaluate the loss in: the model's own dtype, or float64.

Finite differences lose about half the digits of the dtype they are computed in. In float32 a well-chosen probe
still resolves relative errors of ~1e-5, but a 16-bit model (``precision="bf16-true"``) leaves ~1e-2 at best, far
from a 1% error. Evaluating the perturbed losses in float64 removes the numerical noise almost entirely, at the price
of float64 kernels (about 2x slower on CPUs and data-centre GPUs, far slower on consumer GPUs; a few operations have no
float64 kernel at all) and of a float64 copy of the parameters and buffers during the check.

The analytic gradient is never taken from the float64 version: it is the gradient training uses, computed in the
model's own dtype, with its hooks. Only the finite differences move to float64.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch
from torch import Tensor, nn

Precision = Literal["auto", "native", "float64"]
"""``"native"``: probes evaluate the loss in the parameters' own dtype. ``"float64"``: in float64, on float64 views
of the parameters, buffers and floating inputs. ``"auto"``: float64 for 16-bit parameters (whose own finite
differences cannot resolve a 1% error), native otherwise."""

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
def float64_storage(model: nn.Module) -> Iterator[None]:
    """Give every floating parameter and buffer of ``model`` float64 storage, then put the original storage back.

    The module, its parameter and buffer objects, their hooks and the optimizer's references to them stay the same:
    only ``.data`` is swapped. The original storage is not written to, so restoring it is exact.
    """
    saved: list[tuple[Tensor, Tensor]] = []
    try:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.is_floating_point() and tensor.dtype != torch.float64:
                    saved.append((tensor, tensor.data))
                    tensor.data = tensor.data.to(torch.float64)
        yield
    finally:
        for tensor, original in reversed(saved):
            tensor.data = original
