"""A trusted gradient with the rounding of a 16-bit autocast path: the reference a noise floor is measured with.

A correct bf16-autocast gradient differs from the exact derivative by its rounding, a wrong one by its bug; the check
needs to know how far a *correct* one is off without asking the path's own kernels, which are what is checked. In the
spirit of flash-attention's tests (a kernel's error judged against a same-precision PyTorch reference's),
:class:`AutocastRounding` builds that reference from float32 kernels the float32 checks vouch for: below autograd (a
``TorchDispatchMode``, which sees the backward's operations too) it rounds values to the autocast dtype where autocast
would hold them in 16 bits:

* the operands and results of the operations autocast runs in 16 bits (matrix products, convolutions and their
  backward, attention);
* the results of operations on such 16-bit values (activations, dropout, norms, their backward), except where a
  float32 tensor takes part in an elementwise operation (type promotion makes the result float32, as under autocast)
  and except the losses autocast runs in float32.

Its formulas are float32 autograd's (a backward wrong only under autocast is not in it) and its rounding autocast's,
so its distance from the float32 gradient is the noise floor of a correct gradient on the path. Where it cannot tell (a
mixed-dtype norm's weight gradient) it rounds, which can only raise the floor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

_aten = torch.ops.aten
_LOWER_PRECISION = {
    _aten.mm,
    _aten.addmm,
    _aten.bmm,
    _aten.baddbmm,
    _aten.addbmm,
    _aten.convolution,
    _aten.convolution_backward,
    _aten._scaled_dot_product_flash_attention_for_cpu,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward,
}
"""The operations autocast runs in 16 bits, as the dispatcher sees them below autograd (``linear`` and ``matmul``
decompose into the matrix products; convolutions of every dimension into ``convolution``)."""

_FLOAT32 = {
    _aten.nll_loss_forward,
    _aten.nll_loss2d_forward,
    _aten.mse_loss,
    _aten.l1_loss,
    _aten.smooth_l1_loss,
    _aten.huber_loss,
    _aten.binary_cross_entropy,
    _aten.binary_cross_entropy_with_logits,
    _aten.kl_div,
    _aten._log_softmax,
    _aten._softmax,
}
"""Losses (and the softmaxes they start with) that autocast computes in float32."""

_PROMOTING = {
    _aten.add,
    _aten.sub,
    _aten.mul,
    _aten.div,
    _aten.where,
    _aten.addcmul,
    _aten.addcdiv,
    _aten.lerp,
    _aten.maximum,
    _aten.minimum,
    _aten.cat,
    _aten.stack,
}
"""Operations whose result is float32 as soon as one float32 tensor (not a 0-dim scalar) takes part."""


def _floats(values: Any, found: list[Tensor] | None = None) -> list[Tensor]:
    """The floating tensors among ``values`` (an operation's arguments or results), in ``tree_flatten``'s order: walked
    by hand through tuples, lists and dicts, pytree's walk for anything else (for every operation, pytree's walk cost
    more than the operation)."""
    found = [] if found is None else found
    if isinstance(values, Tensor):
        if values.is_floating_point():
            found.append(values)
    elif isinstance(values, (tuple, list)):
        for value in values:
            _floats(value, found)
    elif isinstance(values, dict):
        for value in values.values():
            _floats(value, found)
    elif not isinstance(values, _ATOMS) and values is not None:
        found += [v for v in tree_flatten(values)[0] if isinstance(v, Tensor) and v.is_floating_point()]
    return found


def _mapped(function: Any, values: Any) -> Any:
    """``tree_map(function, values)``, by hand through plain tuples, lists and dicts (see :func:`_floats`)."""
    if isinstance(values, Tensor):
        return function(values)
    kind = type(values)
    if kind is tuple or kind is list:
        return kind(_mapped(function, value) for value in values)
    if kind is dict:
        return {key: _mapped(function, value) for key, value in values.items()}
    if values is None or isinstance(values, _ATOMS):
        return values
    return tree_map(function, values)


_ATOMS = (bool, int, float, complex, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


class AutocastRounding(TorchDispatchMode):
    """Emulates the rounding of autocast to ``dtype`` (``torch.bfloat16`` or ``torch.float16``) on float32 kernels."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.low: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """The tensors autocast would hold in ``dtype``."""

    def _round(self, value: Any) -> Any:
        if isinstance(value, Tensor) and value.dtype in (torch.float32, torch.float64):
            rounded = value.to(self.dtype).to(value.dtype)
            self.low[rounded] = True
            return rounded
        return value

    def _held_low(self, func: Any, args: Any) -> bool:
        floats = _floats(args)
        if not floats:
            return False
        if func.overloadpacket in _PROMOTING:
            return all(t in self.low or t.dim() == 0 for t in floats) and any(t in self.low for t in floats)
        return floats[0] in self.low

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _LOWER_PRECISION:
            args, kwargs = _mapped(self._round, (args, kwargs))
            return _mapped(self._round, func(*args, **kwargs))
        if packet in _FLOAT32 or not self._held_low(func, (args, kwargs)):
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if func._schema.is_mutable:  # in place: round the mutated tensors where they are
            for tensor in _floats(out):
                tensor.copy_(tensor.to(self.dtype))
                self.low[tensor] = True
            return out
        return _mapped(self._round, out)
