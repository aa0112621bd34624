"""A trusted gradient with the rounding of a 16-bit autocast path: the reference a noise floor is measured with.

A correct bf16-autocast gradient differs from the exact derivative by its rounding; a wrong one by its bug. To tell
them apart, an applied check needs to know how far a *correct* gradient of that precision is off, and it cannot ask the
path's own kernels, which are what is being checked. In the spirit of flash-attention's tests (a kernel's error is
judged against the error of a same-precision PyTorch reference), :class:`AutocastRounding` builds that same-precision
reference from float32 kernels that the float32 checks vouch for: during a forward pass it rounds, to the autocast
dtype, the operands and results of exactly the operations autocast runs in 16 bits (matmuls, linear layers,
convolutions, attention), and the gradients flowing back through them, as autocast stores them. Everything else runs
in float32, as autocast runs its float32 operations (softmax, norms, losses).

Its backward is float32 autograd's, so a backward that is wrong only under autocast (the fault checked for) is not in
it; its rounding is autocast's storage rounding, so its distance from the float32 gradient is the noise floor of a
correct gradient on the path. Elementwise operations on 16-bit activations (which autocast rounds and the emulation
does not) make the emulation slightly more precise than the real path: the verdict allows a multiple of the floor
(:data:`~gradwatch.engine.applied.verdict.FLOOR_MULTIPLE`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

_LOWER_PRECISION: set[Callable[..., Any]] = {
    F.linear,
    F.bilinear,
    F.conv1d,
    F.conv2d,
    F.conv3d,
    F.conv_transpose1d,
    F.conv_transpose2d,
    F.conv_transpose3d,
    F.prelu,
    F.scaled_dot_product_attention,
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.addmm,
    torch.addbmm,
    torch.baddbmm,
    torch.einsum,
    Tensor.matmul,
    Tensor.__matmul__,
    Tensor.mm,
    Tensor.bmm,
}
"""The operations autocast runs in 16 bits (its ``lower_precision_fp`` list, as Python sees them)."""


class _Rounded(torch.autograd.Function):
    """Rounds to ``dtype`` and back in the forward, and the incoming gradient likewise in the backward."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, dtype: torch.dtype) -> Tensor:
        ctx.dtype = dtype
        return tensor.to(dtype).to(tensor.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad.to(ctx.dtype).to(grad.dtype), None


def _rounded(dtype: torch.dtype) -> Callable[[Any], Any]:
    def round_one(value: Any) -> Any:
        if isinstance(value, Tensor) and value.dtype in (torch.float32, torch.float64):
            return _Rounded.apply(value, dtype)
        return value

    return round_one


class AutocastRounding(TorchFunctionMode):
    """Emulates the storage rounding of autocast to ``dtype`` on float32 kernels (see the module doc).

    Args:
        dtype: The autocast dtype (``torch.bfloat16`` or ``torch.float16``).
    """

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.round = _rounded(dtype)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _LOWER_PRECISION:
            args, kwargs = tree_map(self.round, (args, kwargs))
            return tree_map(self.round, func(*args, **kwargs))
        if func is F.multi_head_attention_forward:
            # a composite function that calls the operations above inside (after its own dispatch): see them too
            with self:
                return func(*args, **kwargs)
        return func(*args, **kwargs)
