"""A loss that calls ``backward()`` itself, said in gradwatch's words.

gradwatch differentiates the loss ``loss_fn`` returns (``torch.autograd.grad``, which leaves ``.grad`` alone). A loss
that runs ``backward()`` first (or steps an optimizer) frees the graph and writes ``.grad``: the check ends with a
:class:`LossCallsBackwardError` naming ``loss_fn``, after everything the loss changed was put back
(:class:`~gradwatch.engine.function.state.TrainingState` sees a ``.grad`` appear; :func:`loss_gradient` a freed graph).

:func:`gradient` runs the backward with the torch function modes of the forward still active: an activation checkpoint
(``torch.utils.checkpoint``) recomputes its forward inside the backward, and that recomputation must be the same
function as the forward, float64 evaluation (:class:`~gradwatch.engine.function.fidelity.Float64Fidelity`) included.
``torch.autograd.grad`` itself dispatches to the active mode, which runs it with the mode popped: a float64
recomputation would then cast to float32 and torch would refuse it ("tensors saved float64, recomputed float32").
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.graph import _engine_run_backward

from gradwatch.errors import LossCallsBackwardError


def loss_calls_backward(evidence: str) -> str:
    """The message of a :class:`LossCallsBackwardError`, with what showed it."""
    return (
        f"`loss_fn` must return the loss without calling backward() on it ({evidence}): gradwatch differentiates the "
        "loss it returns itself. The parameters, their .grad and the optimizers' state were put back. Pass a loss_fn "
        "that only computes the loss (with Lightning's manual optimization: GradWatch(loss_fn=...))"
    )


def gradient(loss: Tensor, wrt: list[Tensor]) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad(loss, wrt, allow_unused=True)`` of a scalar ``loss``, run by autograd's engine with the
    active torch function modes kept for the backward (see the module doc). ``wrt`` must all require grad."""
    if not wrt:
        return ()
    if not torch.overrides._get_current_function_mode_stack():
        return torch.autograd.grad(loss, wrt, allow_unused=True)
    seed = torch.ones_like(loss)
    return tuple(_engine_run_backward((loss,), (seed,), False, False, tuple(wrt), True, accumulate_grad=False))


def loss_gradient(loss: Tensor, wrt: list[Tensor]) -> list[Tensor | None]:
    """The gradient of the loss (``None`` for a tensor the loss made not require grad), a freed graph said in
    gradwatch's words."""
    differentiable = [t for t in wrt if t.requires_grad]
    try:
        found = iter(gradient(loss, differentiable))
        return [next(found) if t.requires_grad else None for t in wrt]
    except RuntimeError as error:
        if "backward through the graph a second time" in str(error):
            raise LossCallsBackwardError(loss_calls_backward("its graph was already freed by a backward")) from error
        raise
