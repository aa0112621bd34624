"""The loss an optimizer's step applies under Lightning's manual optimization: the step's own loss.

With several optimizers (a GAN), ``training_step`` computes a loss per optimizer, hands each to ``manual_backward``
and steps that optimizer. Optimizer step *k* of a batch applies the gradient of the losses given ``manual_backward``
since the step before it (or the batch's start), its own ``closure=`` included; a step with none since applies the
same backward as the step before (Muon and AdamW on one loss, stepping in turn), and is checked against those losses
at the parameters before that step. :func:`manual_step_loss` makes it a ``loss_fn``: it runs ``training_step`` again
from the batch's start (the window replays the batch's random state, so every draw is the training's) with the
optimizers unable to step and ``manual_backward`` recording its loss instead of differentiating it, and stops at step
*k*. Nothing of the training is done twice: no ``.grad`` is written, no optimizer steps, ``toggle_optimizer`` does
nothing, gradients are not clipped, logging is silenced.

The parameters are as ``training_step`` had them at every point: the callback keeps, at each optimizer step of a
checked batch, the values of that optimizer's parameters before its update (:data:`Earlier`); the run again starts
with those values and moves them on at each held step (:class:`Rewind`, which puts them in the module's slots as a
check puts its float64 copies there: the parameters themselves are never written). So a generator's sample made before
the generator's step and given to the discriminator after it is the training's sample.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor, nn

from gradwatch.engine import LossFn
from gradwatch.integrations.lightning.training_step import _logging_silenced, _replaced, _silenced
from gradwatch.watch.rewind import Earlier, Rewind, before_update

__all__ = ["Earlier", "before_update", "manual_step_loss"]


class _Reached(BaseException):
    """The step whose loss is wanted was reached: ``training_step`` need not go on (a ``BaseException``, so that a
    ``training_step`` catching ``Exception`` lets it through)."""


class _Steps:
    """What the optimizers' stand-ins see: the losses given to ``manual_backward`` since the last step, and steps."""

    def __init__(self, ordinal: int, optimizer: torch.optim.Optimizer, rewind: Rewind) -> None:
        self.ordinal, self.optimizer, self.rewind = ordinal, optimizer, rewind
        self.taken = 0
        self.losses: list[Tensor] = []
        self.shared: list[Tensor] = []  # the losses of the last step that had some: a later step may share them
        self.loss: Tensor | None = None

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        self.losses.append(loss)

    def step(self, optimizer: Any, closure: Any = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None
        self.taken += 1
        if self.taken == self.ordinal:
            raw = getattr(optimizer, "optimizer", optimizer)
            if raw is not self.optimizer:
                raise ValueError(
                    f"training_step run again steps {type(raw).__name__} at its optimizer step {self.ordinal}, where "
                    f"training stepped {type(self.optimizer).__name__}: its optimizer steps depend on more than the "
                    "batch and the random state, so gradwatch cannot tell which loss this step applies"
                )
            losses = self.losses or self.shared  # none since the step before: the steps share one backward
            if not losses:
                raise ValueError(
                    f"training_step gave manual_backward no loss before its optimizer step {self.ordinal}: gradwatch "
                    "cannot tell which loss this step applies"
                )
            self.loss = sum(losses[1:], losses[0])
            raise _Reached
        self.rewind.stepped(self.taken, getattr(optimizer, "optimizer", optimizer))
        self.shared, self.losses = self.losses or self.shared, []
        return result


@contextlib.contextmanager
def _stand_ins(module: pl.LightningModule, steps: _Steps) -> Iterator[None]:
    """The module's optimizers and ``manual_backward`` as :class:`_Steps` sees them (instance attributes shadowing
    the methods, put back exactly)."""
    optimizers = module.optimizers()
    optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
    with contextlib.ExitStack() as stack:
        stack.enter_context(_silenced(module, ("toggle_optimizer", "untoggle_optimizer", "clip_gradients")))
        if callable(getattr(module, "toggled_optimizer", None)):
            stack.enter_context(_replaced(module, "toggled_optimizer", lambda *a, **k: contextlib.nullcontext()))
        stack.enter_context(_replaced(module, "manual_backward", steps.backward))
        for optimizer in optimizers:
            stack.enter_context(_silenced(optimizer, ("zero_grad",)))
            stack.enter_context(_replaced(optimizer, "step", lambda *a, _o=optimizer, **k: steps.step(_o, *a, **k)))
        yield


def manual_step_loss(
    module: pl.LightningModule, batch_idx: int, ordinal: int, optimizer: torch.optim.Optimizer, earlier: Earlier = ()
) -> LossFn:
    """A ``loss_fn`` for the applied check of the ``ordinal``-th optimizer step of a batch (1 for the first), which
    steps ``optimizer``, after the batch's ``earlier`` steps: the step's own loss (see the module doc)."""
    extra = (batch_idx,) if is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2) else ()
    earlier = list(earlier)[: ordinal - 1]

    def loss_fn(_model: nn.Module, batch: Any) -> Tensor:  # called with ``module`` itself
        with Rewind(module, earlier) as rewind:
            steps = _Steps(ordinal, optimizer, rewind)
            with _logging_silenced(module), _stand_ins(module, steps), contextlib.suppress(_Reached):
                module.training_step(batch, *extra)
        if steps.loss is None:
            raise ValueError(
                f"training_step run again took {steps.taken} optimizer step(s), fewer than the {ordinal} training took "
                "in this batch: gradwatch cannot tell which loss this step applies"
            )
        return steps.loss

    return loss_fn
