"""Which of the batch's floating inputs a check may differentiate and probe.

Input probes make the batch's floating tensors require grad for the reference pass. That is only sound when the loss
does not look: a metric library that asserts ``not target.requires_grad`` refuses it (the check then differentiates no
input, with a note), and a loss that detaches an input (a gradient penalty's ``interpolates.detach()``, a PDE
residual's ``x.detach().requires_grad_()``) computes a gradient with respect to it that is deliberately not its
derivative. :class:`StopGradientWatch`, active during the reference pass, finds the inputs a ``detach`` reaches, and
those are not probed (a note names them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

_DETACHES = {Tensor.detach, torch.detach, Tensor.detach_, Tensor.data.__get__}  # type: ignore[attr-defined]


def _reached_leaves(tensor: Tensor, wanted: Mapping[int, str]) -> set[str]:
    """The paths of the ``wanted`` leaves (by ``id``) that ``tensor`` depends on through autograd's graph."""
    if id(tensor) in wanted:
        return {wanted[id(tensor)]}
    found: set[str] = set()
    stack = [tensor.grad_fn] if tensor.grad_fn is not None else []
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None and id(variable) in wanted:
            found.add(wanted[id(variable)])
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return found


class StopGradientWatch(TorchFunctionMode):
    """Records which of the leaves ``leaves`` (path to tensor) a ``detach`` inside the loss cuts off.

    Only tensors that require grad are followed back; a detach of an activation that depends on parameters alone
    (a GAN's ``fake.detach()``) walks the graph once and finds nothing.
    """

    def __init__(self, leaves: Mapping[str, Tensor]) -> None:
        super().__init__()
        self._wanted = {id(tensor): path for path, tensor in leaves.items()}
        self.detached: set[str] = set()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        cutting = func in _DETACHES and args and isinstance(args[0], Tensor) and args[0].requires_grad
        if cutting and len(self.detached) < len(self._wanted):
            self.detached |= _reached_leaves(args[0], self._wanted)
        return func(*args, **(kwargs or {}))


def unprobed_note(detached: set[str]) -> str | None:
    """The note naming the inputs a ``detach`` in the loss reaches, which are not probed."""
    if not detached:
        return None
    return (
        f"inputs not probed: {', '.join(sorted(detached))} (the loss detaches them: their gradient is deliberately "
        "not their derivative)"
    )
