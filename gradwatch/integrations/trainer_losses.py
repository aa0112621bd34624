"""What a check of a Trainer's own ``compute_loss`` must know about the loss it computes.

Most trainers train on the derivative of the value their ``compute_loss`` returns. A trainer whose loss is a
**surrogate objective** does not: GRPO's policy loss with one optimisation pass per generation (TRL's default,
``num_iterations=1``) is built on ``exp(logp - logp.detach())``, 1 at every point, so its value is flat in the
parameters while its gradient is the policy gradient. For such trainers, recognised without importing TRL by the name of
a class in their hierarchy (:data:`SURROGATE_TRAINERS`), the callback checks the function autograd differentiates: the
values the loss detaches outside the model's forward are held at the reference's
(:attr:`~gradwatch.engine.settings.ProbeSettings.hold_detached`, :mod:`gradwatch.engine.function.held`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from gradwatch.engine.function.evaluation import LossFn
from gradwatch.engine.settings import ProbeSettings
from gradwatch.watch.options import WatchOptions

SURROGATE_TRAINERS = frozenset({"GRPOTrainer", "SDPOTrainer"})
"""Trainers whose ``compute_loss`` detaches the policy's own log-probabilities to build its ratio (TRL's
``GRPOTrainer`` and the trainers derived from it, its experimental ``SDPOTrainer``): checked with ``hold_detached``."""


def surrogate_objective(trainer: Any) -> bool:
    """Whether ``trainer``'s own loss is a surrogate objective (see the module doc)."""
    return any(cls.__name__ in SURROGATE_TRAINERS for cls in type(trainer).__mro__)


def trainer_options(trainer: Any, settings: ProbeSettings | None, options: WatchOptions) -> WatchOptions:
    """The options the callback passes on to its watch: ``options``, with ``hold_detached=True`` added when the check's
    loss is the trainer's own surrogate objective (no ``loss_fn`` given) and neither ``hold_detached`` nor ``settings``
    was given (settings given whole are taken as they are)."""
    given = options.get("loss_fn") is not None or settings is not None or "hold_detached" in options
    if not given and surrogate_objective(trainer):
        return {**options, "hold_detached": True}
    return options


def compute_loss_with_count(compute_loss: Callable[..., Any], num_items_in_batch: torch.Tensor | int | None) -> LossFn:
    """A Trainer's ``compute_loss`` as a check's ``loss_fn(model, inputs)``, with the ``num_items_in_batch`` the
    Trainer passed (a copy of the inputs each call: ``compute_loss`` may pop the labels)."""
    count: Any = num_items_in_batch
    if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.dim() == 0:
        # The same count as a number (the loss divides by it exactly either way): the Trainer's float tensor would
        # be a floating input of the model to the culprit search, which cannot displace it.
        count = num_items_in_batch.item()

    def loss_fn(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        return cast(torch.Tensor, compute_loss(model, dict(inputs), num_items_in_batch=count))

    return loss_fn


def no_micro_batch(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of a due step whose micro-batch the callback did not see: an error the watch reports."""
    raise RuntimeError(
        "gradwatch saw no micro-batch of this step: the Trainer's training_step did not call trainer.compute_loss"
    )
