"""``GradWatchCallback``: gradient checks in a Hugging Face ``transformers.Trainer`` run (and the TRL trainers on it).

A thin adapter over :class:`gradwatch.watch.GradientWatch`. A ``TrainerCallback`` sees neither the batch nor the loss,
so the callback cooperates with the Trainer it is built with (the pattern of TRL's callbacks): during training it
wraps ``trainer.compute_loss`` to keep the first micro-batch of each optimizer step that may be checked (a shallow copy
of the inputs dict, since ``compute_loss`` may pop the labels) and the ``num_items_in_batch`` the Trainer passed with
it. At ``on_step_end`` (after the optimizer step; ``state.global_step`` counts optimizer steps) it runs the check: the
loss is the Trainer's own ``compute_loss`` on the kept micro-batch, at the parameters the step produced. Scalars go
through ``trainer.log`` (so to every ``report_to`` integration) at the steps with a check only.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from gradwatch.engine import CheckReport, LossFn
from gradwatch.watch.distributed import agree_across_ranks, rank0_decides
from gradwatch.watch.watch import GradientWatch

__all__ = ["GradWatchCallback"]


class GradWatchCallback(TrainerCallback):
    r"""Check, every so often during a ``transformers.Trainer`` run, that the gradients are the derivatives of the loss.

    At the optimizer steps the schedule picks, the check evaluates the Trainer's own ``compute_loss`` on one
    micro-batch of that step (the first, under gradient accumulation) with ``num_items_in_batch`` as the Trainer passed
    it, at the parameters after the step, and compares autograd's gradient with finite differences. Training is left
    bit for bit as it would be without the callback (parameters, optimizer state, random states, the Trainer's own
    logged values).

    Each check's scalars (``gradwatch/verdict``, ``gradwatch/failing_probes``, ``gradwatch/rel_error_max``, ...;
    ``gradwatch/overhead``) are sent with ``trainer.log``: they reach every ``report_to`` integration and make one
    entry of ``trainer.state.log_history`` of their own at that step (with ``step`` and ``epoch``, no ``loss``), beside
    the Trainer's own entries, which stay as they were. Failures warn (a :class:`~gradwatch.GradientCheckWarning` with
    the culprit), as ``on_fail`` says; ``on_fail="stop"`` stops training at the end of the step.

    Args:
        trainer: The ``Trainer`` to watch; add the callback to it with ``trainer.add_callback(callback)``.
        every_n_steps: Check every this many optimizer steps (see :class:`~gradwatch.GradientWatch`).
        loss_fn: ``loss_fn(model, inputs) -> scalar Tensor`` to check instead of ``trainer.compute_loss`` (for a
            ``compute_loss`` with side effects of its own, e.g. one that records metrics at each call).
        **options: Any other option of :class:`~gradwatch.GradientWatch` (``first_check_step``, ``on_fail``,
            ``max_overhead``, ``verbose``, ``sinks``, the probe options of
            :class:`~gradwatch.engine.settings.ProbeSettings`).

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        trainer.add_callback(GradWatchCallback(trainer, every_n_steps=100))
        trainer.train()
    """

    def __init__(
        self, trainer: Trainer, every_n_steps: int | None = None, loss_fn: LossFn | None = None, **options: Any
    ):
        if not isinstance(trainer, Trainer):
            raise ValueError(f"`trainer` must be a transformers.Trainer; got {type(trainer).__name__}")
        self.trainer = trainer
        self.loss_fn = loss_fn
        # several processes (DDP): rank 0 decides the budget and every process acts on the same report
        options.setdefault("decide", rank0_decides)
        options.setdefault("agree", agree_across_ranks)
        self.watch = GradientWatch(every_n_steps=every_n_steps, loss_fn=loss_fn, on_report=self._log, **options)
        self._kept: tuple[dict[str, Any], Any] | None = None  # (inputs, num_items_in_batch) of the step's micro-batch
        self._keep_next = False  # the next micro-batch of the step is kept
        self._wrapped = False

    @property
    def reports(self) -> list[CheckReport]:
        """The reports of this run's checks, oldest first."""
        return self.watch.reports

    @property
    def counts(self) -> dict[str, int]:
        """See :attr:`gradwatch.GradientWatch.counts`."""
        return self.watch.counts

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        if not self._wrapped:
            # an instance attribute shadows the method (a subclass's override included) for the run's duration
            self._compute_loss = self.trainer.compute_loss
            self.trainer.compute_loss = self._keeping_compute_loss  # type: ignore[method-assign]
            self._wrapped = True
        self.watch.setup(self._model)
        self.watch.start(state.global_step)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        if self._wrapped and "compute_loss" in vars(self.trainer):
            del self.trainer.compute_loss
        self._wrapped = False
        self._kept = None

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        # keep a micro-batch only for a step that may be checked (a due or postponed check)
        self._keep_next = self.watch.due_next(state.global_step)
        self._kept = None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        kept, self._kept, self._keep_next = self._kept, None, False
        # called at every step, due or not: the watch measures the training time between calls
        inputs, num_items_in_batch = kept if kept is not None else (None, None)
        loss_fn = self.loss_fn or (self._trainer_loss(num_items_in_batch) if kept is not None else _no_micro_batch)
        self.watch.maybe_check(
            self._model,
            inputs,
            loss_fn,
            step=state.global_step,
            skipped=lambda: bool(getattr(self.trainer.accelerator, "optimizer_step_was_skipped", False)),
            optimizers=() if self.trainer.optimizer is None else (self.trainer.optimizer,),
        )
        if self.watch.should_stop:  # on_fail="stop" and the check failed
            control.should_training_stop, self.watch.should_stop = True, False

    @property
    def _model(self) -> nn.Module:
        """The model the Trainer trains (unwrapped: a DDP wrapper would run its reductions on the check's passes)."""
        if self.trainer.model is None:
            raise RuntimeError("gradwatch: the Trainer has no model yet")
        return self.trainer.model

    def _keeping_compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        if self._keep_next and model.training:
            self._kept, self._keep_next = (dict(inputs), num_items_in_batch), False  # compute_loss may pop labels
        return self._compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def _trainer_loss(self, num_items_in_batch: torch.Tensor | int | None) -> LossFn:
        compute_loss = self._compute_loss
        count: Any = num_items_in_batch
        if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.dim() == 0:
            # The same count as a number (the loss divides by it exactly either way): the Trainer's float tensor would
            # be a floating input of the model to the culprit search, which cannot displace it.
            count = num_items_in_batch.item()

        def loss_fn(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
            return cast(torch.Tensor, compute_loss(model, dict(inputs), num_items_in_batch=count))

        return loss_fn

    def _log(self, report: CheckReport) -> None:
        scalars = {**report.scalars(), "gradwatch/overhead": self.watch.overhead}
        # Trainer.log clears control.should_log, which the Trainer set for its own entry of this step: put it back, or
        # the Trainer would skip (and later average over) the loss it logs at this step
        should_log = self.trainer.control.should_log
        self.trainer.log({tag: float(value) for tag, value in scalars.items() if value == value})  # NaN dropped
        self.trainer.control.should_log = should_log


def _no_micro_batch(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of a due step whose micro-batch the callback did not see: an error the watch reports."""
    raise RuntimeError(
        "gradwatch saw no micro-batch of this step: the Trainer's training_step did not call trainer.compute_loss"
    )
