"""``GradWatchCallback``: gradient checks in a Hugging Face ``transformers.Trainer`` run (and the TRL trainers on it).

A thin adapter over :class:`gradwatch.watch.GradientWatch`: it turns the Trainer's events into the watch's calls and
lends it what only the Trainer knows (the micro-batch, the loss, where the logs go, the checkpoint's state). A
``TrainerCallback`` sees neither the batch nor the loss, so the callback cooperates with the Trainer it is built with
(the pattern of TRL's callbacks): during training it wraps ``trainer.compute_loss`` to keep the first micro-batch of
each optimizer step that may be checked (a shallow copy of the inputs dict, since ``compute_loss`` may pop the labels)
and the ``num_items_in_batch`` the Trainer passed with it. At ``on_step_end`` (after the optimizer step;
``state.global_step`` counts optimizer steps) the watch runs its check of the Trainer's own ``compute_loss`` on the kept
micro-batch, at the parameters the step produced.

Outputs go through the watch's sinks, built once per run at ``on_train_begin`` (:meth:`GradWatchCallback._run_sinks`):
the scalars through ``trainer.log`` (every ``report_to`` integration), the histogram and the failure text into the
Trainer's TensorBoard run, and the JSON lines record beside the logs. The watch's state rides in the Trainer's
checkpoints (``trainer_state.json``, under ``stateful_callbacks``), so a resumed run continues its schedule. What
``compute_loss`` records during a check (TRL's metrics and token counts) is put back after it (:mod:`.records`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.integrations.integration_utils import MLflowCallback, TensorBoardCallback, WandbCallback

from gradwatch.engine import CheckReport, LossFn
from gradwatch.integrations.records import records_kept
from gradwatch.outputs.beside import record_directory
from gradwatch.outputs.jsonl import JSONL_NAME
from gradwatch.outputs.sinks import GuardedSink, JsonLinesSink, LogCallSink, Sink, SummaryWriterSink
from gradwatch.tensorboard.writer import TRAINER_PREFIX
from gradwatch.watch.alerts import OnFail
from gradwatch.watch.defaults import DEFAULT_MAX_OVERHEAD
from gradwatch.watch.distributed import agree_across_ranks, rank0_decides
from gradwatch.watch.hooks import Agree, Context, Decide
from gradwatch.watch.watch import GradientWatch

__all__ = ["STATE_KEY", "GradWatchCallback"]

STATE_KEY = "gradwatch"
"""The key of the watch's state in ``TrainerState.stateful_callbacks`` (saved in each checkpoint's
``trainer_state.json``). Not the callback's class name: with ``restore_callback_states_from_checkpoint=True`` the
Trainer rebuilds a callback of that name from JSON arguments, which cannot hold the trainer."""


class GradWatchCallback(TrainerCallback):
    r"""Check, every so often during a ``transformers.Trainer`` run, that the gradients are the derivatives of the loss.

    At the optimizer steps the schedule picks, the check evaluates the Trainer's own ``compute_loss`` on one
    micro-batch of that step (the first, under gradient accumulation) with ``num_items_in_batch`` as the Trainer passed
    it, at the parameters after the step, and compares autograd's gradient with finite differences. Training is left
    bit for bit as it would be without the callback (parameters, optimizer state, random states, the Trainer's own
    log entries).

    Each check's records go, as in every loop, to the watch's sinks: the scalars (``gradwatch/verdict``,
    ``gradwatch/rel_error_max`` and its ``gradwatch/rel_error_max_log10``, ..., ``gradwatch/overhead``) through
    ``trainer.log``, so to every ``report_to`` integration, as one entry of ``trainer.state.log_history`` of their own
    at that step; in a TensorBoard run also the histogram of log10 relative errors and, when a check failed, its text
    with the culprit (``train/gradwatch/failures``); and one line per check in ``gradwatch.jsonl`` beside the logs (the
    TensorBoard run's directory, else ``output_dir``), which ``gradwatch report`` reads. Failures warn (a
    :class:`~gradwatch.GradientCheckWarning` with the culprit), as ``on_fail`` says; ``on_fail="stop"`` stops training
    at the end of the step. The watch's state (schedule, budget, counters, backoff) is saved in the Trainer's
    checkpoints and restored by ``trainer.train(resume_from_checkpoint=...)``.

    Args:
        trainer: The ``Trainer`` to watch; add the callback to it with ``trainer.add_callback(callback)``.

    Keyword Args:
        every_n_steps: Check every this many optimizer steps (see :class:`~gradwatch.GradientWatch`).
        first_check_step: Also check at this optimizer step; ``None`` for none.
        on_fail: ``"warn"``, ``"raise"``, ``"stop"`` or a callable (see :class:`~gradwatch.GradientWatch`).
        loss_fn: ``loss_fn(model, inputs) -> scalar Tensor`` to check instead of ``trainer.compute_loss`` (for a
            ``compute_loss`` with side effects of its own, e.g. one that records metrics at each call).
        max_overhead: The budget, a fraction of the training time the checks may take: 1% by default **whatever the
            cadence**, one given by hand included (a due check that does not fit is postponed and counted in
            ``counts["postponed"]``); ``None`` checks on schedule, at any cost.
        max_reports: How many reports :attr:`reports` keeps.
        verbose: Log what is worth knowing but is no failure (see :class:`~gradwatch.GradientWatch`).
        sinks: More outputs for every check's records, besides the run's own.
        on_report: Called with each report (see :class:`~gradwatch.GradientWatch`).
        context: A context manager around each check (see :class:`~gradwatch.GradientWatch`).
        decide, agree: The budget decision and the report every process acts on; by default those of
            :mod:`gradwatch.watch.distributed` (rank 0 decides, every process acts on the same report).
        **options: The probe options of :class:`~gradwatch.engine.settings.ProbeSettings`.

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        trainer.add_callback(GradWatchCallback(trainer, every_n_steps=100))
        trainer.train()
    """

    def __init__(
        self,
        trainer: Trainer,
        *,
        every_n_steps: int | None = None,
        first_check_step: int | None = 1,
        on_fail: OnFail = "warn",
        loss_fn: LossFn | None = None,
        max_overhead: float | None = DEFAULT_MAX_OVERHEAD,
        max_reports: int = 1000,
        verbose: bool = True,
        sinks: Sequence[Sink] = (),
        on_report: Callable[[CheckReport], object] | None = None,
        context: Context | None = None,
        decide: Decide | None = None,
        agree: Agree | None = None,
        **options: Any,
    ):
        if not isinstance(trainer, Trainer):
            raise ValueError(f"`trainer` must be a transformers.Trainer; got {type(trainer).__name__}")
        self.trainer = trainer
        self.loss_fn = loss_fn
        self.watch = GradientWatch(
            every_n_steps=every_n_steps,
            first_check_step=first_check_step,
            on_fail=on_fail,
            loss_fn=loss_fn,
            max_overhead=max_overhead,
            max_reports=max_reports,
            verbose=verbose,
            sinks=sinks,
            on_report=on_report,
            context=self._records_kept,
            # several processes (DDP): rank 0 decides the budget and every process acts on the same report
            decide=decide or rank0_decides,
            agree=agree or agree_across_ranks,
            **options,
        )
        self._sinks = tuple(sinks)  # the user's; the run's own are added at each on_train_begin
        self._context = context
        self._kept: tuple[dict[str, Any], Any] | None = None  # (inputs, num_items_in_batch) of the step's micro-batch
        self._keep_next = False  # the next micro-batch of the step is kept
        self._wrapped = False
        self._pending_logs: list[dict[str, float | str]] = []  # logged at the end of the step they belong to

    @property
    def reports(self) -> list[CheckReport]:
        """The reports of this run's checks, oldest first."""
        return self.watch.reports

    @property
    def counts(self) -> dict[str, int]:
        """See :attr:`gradwatch.GradientWatch.counts` (continued from the checkpoint on resume)."""
        return self.watch.counts

    # --- the Trainer's events --------------------------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        if not self._wrapped:
            # an instance attribute shadows the method (a subclass's override included) for the run's duration
            self._compute_loss = self.trainer.compute_loss
            self.trainer.compute_loss = self._keeping_compute_loss  # type: ignore[method-assign]
            self._wrapped = True
        self.watch.sinks = (*self._sinks, *self._run_sinks(args, state))
        self._restore_state(state)
        self.watch.setup(self._model)
        self.watch.start(state.global_step)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        if self._wrapped and "compute_loss" in vars(self.trainer):
            del self.trainer.compute_loss
        self._wrapped = False
        self._kept = None
        self.watch.sinks = self._sinks  # the run's writers close with it

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        # keep a micro-batch only for a step that may be checked (a due or postponed check)
        self._keep_next = self.watch.due_next(state.global_step)
        self._kept = None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        self._log_pending()
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
        self._save_state(state)  # before the Trainer saves a checkpoint of this step
        if self.watch.should_stop:  # on_fail="stop" and the check failed
            control.should_training_stop, self.watch.should_stop = True, False

    @property
    def _model(self) -> nn.Module:
        """The model the Trainer trains (unwrapped: a DDP wrapper would run its reductions on the check's passes)."""
        if self.trainer.model is None:
            raise RuntimeError("gradwatch: the Trainer has no model yet")
        return self.trainer.model

    # --- the state in the Trainer's checkpoints ---------------------------------------------------------------------

    def _restore_state(self, state: TrainerState) -> None:
        """Continue from the watch's state in ``state`` (a checkpoint's, on resume), if it holds one."""
        saved = _stateful(state).get(STATE_KEY)
        if isinstance(saved, dict):
            self.watch.load_state_dict(saved)
        self._save_state(state)

    def _save_state(self, state: TrainerState) -> None:
        """Keep the watch's state in ``state``, where the Trainer's next checkpoint saves it (plain JSON values)."""
        _stateful(state)[STATE_KEY] = self.watch.state_dict()

    # --- outputs --------------------------------------------------------------------------------------------------

    def _run_sinks(self, args: TrainingArguments, state: TrainerState) -> list[Sink]:
        """The run's outputs: the scalars through ``trainer.log`` (every process: each keeps its log history); on the
        main process, the histogram and the failure text into the Trainer's TensorBoard run, and the JSON lines record
        beside the logs (:meth:`_record_directories`)."""
        sinks: list[Sink] = [LogCallSink(self._log)]
        if not state.is_world_process_zero:
            return sinks
        board = next((c for c in self.trainer.callback_handler.callbacks if isinstance(c, TensorBoardCallback)), None)
        writer = getattr(board, "tb_writer", None)
        if writer is not None:
            # the scalars reach it through trainer.log, as train/gradwatch/...: the rest beside them
            sinks.append(GuardedSink(SummaryWriterSink(writer, scalars=False, prefix=TRAINER_PREFIX)))
        directories = self._record_directories(
            args, getattr(writer, "log_dir", None) or getattr(board, "logging_dir", None)
        )
        sinks += [GuardedSink(JsonLinesSink(directory / JSONL_NAME)) for directory in directories]
        return sinks

    def _record_directories(self, args: TrainingArguments, board: str | None) -> list[Path]:
        """Where the JSON lines record goes: the TensorBoard run's directory (``board``), and for a Weights & Biases or
        MLflow run, ``<output_dir>/gradwatch_records/<callback>-<run id>`` (beside their run folders, where
        ``gradwatch report`` looks: :mod:`gradwatch.outputs.beside`); without any of these, ``output_dir``."""
        root = Path(args.output_dir or ".")
        directories = [Path(board)] if board else []
        for callback in self.trainer.callback_handler.callbacks:
            run_id = _tracking_run_id(callback)
            if run_id:
                directories.append(record_directory(root, type(callback).__name__, run_id))
        return directories or [Path(getattr(args, "logging_dir", None) or root)]

    def _log(self, values: dict[str, float | str], step: int) -> None:
        """Send a check's values through ``trainer.log`` at the Trainer's ``step``: at once when the Trainer is there,
        else (an applied check, before its optimizer step) at that step's end."""
        if step > self.trainer.state.global_step:
            self._pending_logs.append(values)
            return
        # Trainer.log clears control.should_log, which the Trainer set for its own entry of this step: put it back, or
        # the Trainer would skip (and later average over) the loss it logs at this step
        should_log = self.trainer.control.should_log
        # The base class's log: a subclass's (TRL's) merges the metrics it gathered since its last entry into any entry
        # and clears them, so they would move from the Trainer's own entry of this step into gradwatch's.
        Trainer.log(self.trainer, cast(dict[str, float], values))
        self.trainer.control.should_log = should_log

    def _log_pending(self) -> None:
        pending, self._pending_logs = self._pending_logs, []
        for values in pending:
            self._log(values, self.trainer.state.global_step)

    # --- the loss ---------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _records_kept(self, model: nn.Module) -> Iterator[None]:
        """Around each check: what the trainer's ``compute_loss`` records (TRL's ``_metrics``, token counts) is put
        back afterwards; inside it, the ``context`` given to the callback, if any."""
        with records_kept(self.trainer), self._context(model) if self._context else contextlib.nullcontext():
            yield

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


def _tracking_run_id(callback: TrainerCallback) -> str | None:
    """The run id of a Weights & Biases or MLflow integration callback once its run started, else ``None`` (read from
    the objects they keep, without importing wandb or mlflow)."""
    try:
        if isinstance(callback, WandbCallback):
            run = getattr(getattr(callback, "_wandb", None), "run", None)
            return None if run is None else str(run.id)
        if isinstance(callback, MLflowCallback):
            active = getattr(callback, "_ml_flow", None)
            run = active.active_run() if active is not None else None
            return None if run is None else str(run.info.run_id)
    except Exception:  # a tracking tool's state must not end the run: its record then goes to output_dir
        return None
    return None


def _stateful(state: TrainerState) -> dict[str, Any]:
    """``state.stateful_callbacks``: a dict of states by name (a list before the Trainer's ``TrainerState`` turns it
    into one)."""
    if not isinstance(state.stateful_callbacks, dict):
        state.stateful_callbacks = {}  # type: ignore[assignment]
    return cast(dict[str, Any], state.stateful_callbacks)


def _no_micro_batch(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of a due step whose micro-batch the callback did not see: an error the watch reports."""
    raise RuntimeError(
        "gradwatch saw no micro-batch of this step: the Trainer's training_step did not call trainer.compute_loss"
    )
