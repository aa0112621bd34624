"""The rounding of a model whose parameters are 16-bit (``model.to(torch.bfloat16)``, no autocast), emulated on precise
storage: the reference a pure-16-bit model's noise floor is measured with.

A correct bf16 gradient differs from the exact derivative by its rounding; a wrong one by its bug too. To tell them
apart a check must know how far a *correct* gradient of that precision is off, without asking the model's own 16-bit
kernels, which are what is being checked. As the applied check does for autocast
(:mod:`gradwatch.engine.applied.gradients`), :class:`SixteenBitRounding` rounds, below autograd (the backward's
operations too), every floating result of a non-mutating operation of kernels the float32 and float64 checks vouch for
to the 16-bit dtype. It rounds more than the model does (its float32 losses, softmaxes and accumulators): its distance
from the precise gradient can only overstate the floor. Its formulas are the precise storage's, so a backward wrong
only for 16-bit inputs (a custom kernel's 16-bit branch) is not in it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

SIXTEEN_BIT = (torch.bfloat16, torch.float16)
"""The dtypes whose models get a measured noise floor instead of a fixed tolerance."""


class SixteenBitRounding(TorchDispatchMode):
    """Rounds the float32 and float64 results of every non-mutating operation to ``dtype`` (bfloat16 or float16)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def _round(self, value: Any) -> Any:
        if isinstance(value, Tensor) and value.dtype in (torch.float32, torch.float64):
            return value.to(self.dtype).to(value.dtype)
        return value

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable:  # buffers written in place (state restored, running statistics): left alone
            return out
        return tree_map(self._round, out)
