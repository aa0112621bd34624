"""The single-device replay: the update check of an optimizer gradwatch has no reference rule for (a custom class,
bitsandbytes', DeepSpeed's own, an Adam that counts steps per group).

The same optimizer class is built anew over a copy of one parameter, with its param group's hyperparameters, a copy of
that parameter's state and the gradient the loop should step with, and stepped once on that tensor alone, in its own
dtype and device: the real optimizer's update must be that one, up to rounding. The replay sees what sharding,
partitioning, a gradient other than the verified one or an update made elsewhere does to a whole tensor's update; not
an algorithm wrong in itself (it runs the same one), nor an optimizer that couples tensors (a global norm over every
parameter). The real optimizer is never touched.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gradwatch.errors import ReplayError

__all__ = ["ReplayError", "replayed"]


def _built(cls: type, param: Tensor, hyper: Mapping[str, Any], defaults: Mapping[str, Any]) -> Any:
    """``cls`` over ``[param]`` with the group's hyperparameters: as one param group (every constructor takes that),
    with the constructor's required arguments taken from the group or the optimizer's defaults."""
    group = {"params": [param], **hyper}
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        signature = None
    required: dict[str, Any] = {}
    if signature is not None:
        for name, parameter in list(signature.parameters.items())[1:]:
            if parameter.default is inspect.Parameter.empty and parameter.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
            ):  # fmt: skip
                source = hyper if name in hyper else defaults
                if name not in source:
                    raise ReplayError(f"{cls.__name__} needs `{name}`, which its param group does not hold")
                required[name] = copy.deepcopy(source[name])
    try:
        return cls([group], **required)
    except Exception as error:  # the user's class: any error means it cannot be replayed
        raise ReplayError(f"{cls.__name__} could not be built over a copy of the parameter: {error}") from error


def replayed(
    optimizer: Any, before: Tensor, grad: Tensor, state: Mapping[str, Any], hyper: Mapping[str, Any]
) -> Tensor:
    """The parameter after one step of a new ``type(optimizer)`` over a copy of ``before`` with gradient ``grad``, the
    param group's ``hyper`` and a copy of the kept ``state`` (see the module doc)."""
    param = torch.nn.Parameter(before.detach().clone(), requires_grad=True)
    param.grad = grad.detach().clone().to(before.dtype)
    twin = _built(type(optimizer), param, hyper, getattr(optimizer, "defaults", {}))
    if state:
        twin.state[param] = {k: v.detach().clone() if isinstance(v, Tensor) else copy.deepcopy(v)
                             for k, v in state.items()}  # fmt: skip
    try:
        twin.step()
    except Exception as error:
        raise ReplayError(f"the replayed {type(optimizer).__name__}.step() raised: {error}") from error
    return param.detach()
