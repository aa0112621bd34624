"""The values a 16-bit model's own forward computed, replayed into a precise evaluation of it: a draw of a 16-bit
model's noise floor that emulating its rounding cannot give.

Emulated rounding (:class:`~gradwatch.engine.function.sixteen_bit.SixteenBitRounding`) rounds each operation's result
once; a real 16-bit kernel also rounds inside (float16 BatchNorm on CPU returned ReLU inputs of 8e-4 and 9e-4 as -8e-5
and -3e-4). Moved across a kink, a value takes its unit's whole contribution to the gradient with it: the correct
float16 gradient of a CNN's BatchNorm bias was 1.26% off the exact one, its emulated rounding 0.03%, and the check
failed it.

:class:`NativeValues` records the output of every leaf module in the model's own forward (during a native backward the
check makes anyway), and :meth:`NativeValues.replayed` makes a precise forward take those values at every leaf module's
output (``o + (native - o).detach()``): the precise gradient at the native forward's decisions (which units a ReLU
passes, which element a pool picks), 1.25% off the exact one above. The backward formulas stay precise, so a backward
wrong only for 16-bit inputs is not in it. A module whose native output is further from its precise output than
:data:`OWN_ROUNDING` allows is not replayed: that is more than the rounding of its result (an ill-conditioned
operation, or a forward wrong in 16 bits), and must not widen the floor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch.engine.function.sixteen_bit import SIXTEEN_BIT

OWN_ROUNDING = 4.0
"""How far a replayed module's native output may be from its precise output on the same inputs (relative, RMS), in
units of the native dtype's epsilon. Small 16-bit models (convolutions, BatchNorm, a decoder's norms and projections)
measured at most 0.75, every upstream error included."""


@contextlib.contextmanager
def _forward_hooks(hooks: list[tuple[nn.Module, Callable[..., Any]]]) -> Iterator[None]:
    """Each ``(module, hook)`` registered as a forward hook for the duration."""
    handles = [module.register_forward_hook(hook) for module, hook in hooks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if next(module.children(), None) is None]


class NativeValues:
    """The leaf modules' outputs of one native forward of ``model``, in call order (see the module doc)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.outputs: dict[int, list[Tensor]] = {}
        self.unreplayed: set[str] = set()
        """Modules whose native output was too far from the precise one to be replayed (their names)."""

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record every 16-bit tensor a leaf module returns during the block. A module computing in float32 inside a
        16-bit model (a sinusoidal time embedding) is left to float64: its rounding moves no kink a 16-bit one would,
        and an ill-conditioned float32 operation (the sine of a timestep near 1000) is further from float64 than 4
        units, without a bug."""
        self.outputs = {}

        def record(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, Tensor) and output.dtype in SIXTEEN_BIT:
                # a copy: a later in-place operation (ReLU(inplace=True) after a BatchNorm) would change a view
                self.outputs.setdefault(id(module), []).append(output.detach().clone())

        with _forward_hooks([(module, record) for _, module in _leaves(self.model)]):
            yield

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Make every leaf module's output in the block the recorded native value (the gradient flowing through the
        precise output), call by call."""
        calls: dict[int, int] = {}

        def replay(name: str, module: nn.Module, output: Any) -> Any:
            recorded = self.outputs.get(id(module), [])
            index = calls.get(id(module), 0)
            calls[id(module)] = index + 1
            if not isinstance(output, Tensor) or index >= len(recorded) or recorded[index].shape != output.shape:
                return None
            native, precise = recorded[index], output.detach().double()
            if (native.double() - precise).norm() > OWN_ROUNDING * torch.finfo(native.dtype).eps * precise.norm():
                self.unreplayed.add(name)
                return None
            return output + (native.to(output.dtype) - output).detach()

        hooks = [
            (module, lambda m, a, o, name=name: replay(name, m, o))
            for name, module in _leaves(self.model)
            if id(module) in self.outputs
        ]
        with _forward_hooks(hooks):
            yield
