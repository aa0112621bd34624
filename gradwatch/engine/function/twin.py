"""A float32 twin of a 16-bit model, on which a culprit search can see what the model's own precision hides.

16-bit arithmetic leaves autograd's gradient ~1e-2 off the derivative (the tolerance is 10% in bfloat16), while an
applied check proves a 3% formula fault on float64 probes against a floor it measures: the search for the module at
fault must run where the formula's error stands above the arithmetic's. The twin is that place: the same modules
(their code, names and hooks) on float32 copies of the parameters and buffers, its inputs promoted alike
(:func:`promoted_batch`). The 16-bit values are exact in float32, so a backward formula wrong there is wrong in the
model.

The twin shares nothing a check changes with the model: its parameters and buffers are its own tensors, each module a
shallow copy with its own containers. Hooks on the model's parameters (``param.register_hook``) are not carried over:
a fault in one is not found on the twin (the search names nothing rather than a wrong module). It costs a float32 copy
of the parameters for the duration of a search.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import Tensor, nn

from gradwatch.engine.function.batch import floating_tensors, replace_tensors
from gradwatch.engine.function.guard import MODULE_DICTS
from gradwatch.engine.function.sixteen_bit import SIXTEEN_BIT

TWIN_NOTE = (
    "the culprit search ran on a float32 twin of the 16-bit model (the same modules on float32 copies of its "
    "parameters, buffers and inputs), where a backward formula's error stands above the arithmetic's"
)


def is_sixteen_bit(model: nn.Module) -> bool:
    """Whether any trainable parameter of ``model`` is bfloat16 or float16."""
    return any(p.requires_grad and p.dtype in SIXTEEN_BIT for p in model.parameters())


def _promoted(tensor: Tensor) -> Tensor:
    return tensor.detach().float() if tensor.dtype in SIXTEEN_BIT else tensor.detach().clone()


def float32_twin(model: nn.Module) -> nn.Module:
    """``model``'s twin: every module shallow-copied with its own containers, every floating parameter and buffer a
    float32 copy (16-bit ones promoted, others cloned), shared modules and tied parameters shared alike."""
    modules: dict[int, nn.Module] = {}
    tensors: dict[int, Any] = {}

    def twin_of(module: nn.Module) -> nn.Module:
        if id(module) in modules:
            return modules[id(module)]
        twin = copy.copy(module)
        modules[id(module)] = twin
        for name in MODULE_DICTS:
            if name in module.__dict__:
                twin.__dict__[name] = copy.copy(module.__dict__[name])
        for name, param in module._parameters.items():
            if param is not None and id(param) not in tensors:
                floating = param.is_floating_point()
                value = _promoted(param) if floating else param.detach().clone()
                tensors[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad and floating)
            twin._parameters[name] = None if param is None else tensors[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None and id(buffer) not in tensors:
                tensors[id(buffer)] = _promoted(buffer) if buffer.is_floating_point() else buffer.clone()
            twin._buffers[name] = None if buffer is None else tensors[id(buffer)]
        for name, child in module._modules.items():
            twin._modules[name] = None if child is None else twin_of(child)
        return twin

    return twin_of(model)


def promoted_batch(batch: Any) -> Any:
    """``batch`` with its 16-bit floating tensors promoted to float32 (the others as they are)."""
    found = {path: t.float() for path, t in floating_tensors(batch).items() if t.dtype in SIXTEEN_BIT}
    return replace_tensors(batch, found) if found else batch
