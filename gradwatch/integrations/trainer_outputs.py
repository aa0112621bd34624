"""Where a Hugging Face ``Trainer`` run's gradwatch records go: the sinks :class:`~gradwatch.integrations.huggingface.
GradWatchCallback` gives the watch once per run, found from the Trainer's own ``report_to`` integrations.

* every process: the scalars through ``trainer.log`` (:class:`~gradwatch.outputs.sinks.LogCallSink`), which reaches
  every integration and keeps each process's log history;
* the main process: in a TensorBoard run, the histogram and the failure text beside the Trainer's ``train/...`` tags
  (the scalars reach it through ``trainer.log``), and the JSON lines record beside the logs: in the TensorBoard run's
  directory, for a Weights & Biases or MLflow run in ``<output_dir>/gradwatch_records/<callback>-<run id>`` (where
  ``gradwatch report`` pointed at their run folder looks: :mod:`gradwatch.outputs.beside`), otherwise in
  ``output_dir``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

from transformers import Trainer, TrainerCallback, TrainerState, TrainingArguments
from transformers.integrations.integration_utils import MLflowCallback, TensorBoardCallback, WandbCallback

from gradwatch.outputs.beside import record_directory
from gradwatch.outputs.jsonl import JSONL_NAME
from gradwatch.outputs.sinks import JsonLinesSink, LogCallSink, Sink, SummaryWriterSink
from gradwatch.tensorboard.writer import TRAINER_PREFIX

__all__ = ["TrainerLog", "record_directories", "run_sinks", "tracking_run_id"]


def run_sinks(
    trainer: Trainer, args: TrainingArguments, state: TrainerState, log: Callable[[dict[str, float | str], int], object]
) -> list[Sink]:
    """The sinks of one run (see the module's docstring); ``log(values, step)`` sends values through ``trainer.log``."""
    sinks: list[Sink] = [LogCallSink(log)]
    if not state.is_world_process_zero:
        return sinks
    board = next((c for c in trainer.callback_handler.callbacks if isinstance(c, TensorBoardCallback)), None)
    writer = getattr(board, "tb_writer", None)
    if writer is not None:
        sinks.append(SummaryWriterSink(writer, scalars=False, prefix=TRAINER_PREFIX))
    board_dir = getattr(writer, "log_dir", None) or getattr(board, "logging_dir", None)
    sinks += [JsonLinesSink(directory / JSONL_NAME) for directory in record_directories(trainer, args, board_dir)]
    return sinks


def record_directories(trainer: Trainer, args: TrainingArguments, board: str | None) -> list[Path]:
    """Where the JSON lines record goes: the TensorBoard run's directory (``board``), and a directory beside each
    Weights & Biases or MLflow run; without any of these, ``output_dir``."""
    root = Path(args.output_dir or ".")
    directories = [Path(board)] if board else []
    for callback in trainer.callback_handler.callbacks:
        run_id = tracking_run_id(callback)
        if run_id:
            directories.append(record_directory(root, type(callback).__name__, run_id))
    return directories or [Path(getattr(args, "logging_dir", None) or root)]


def tracking_run_id(callback: TrainerCallback) -> str | None:
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


class TrainerLog:
    """Sends a check's values through ``trainer.log`` at the Trainer's step: at once when the Trainer is at that step,
    else (an applied check, made before its optimizer step) at that step's end (:meth:`flush`)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.pending: list[dict[str, float | str]] = []

    def __call__(self, values: dict[str, float | str], step: int) -> None:
        if step > self.trainer.state.global_step:
            self.pending.append(values)
            return
        # Trainer.log clears control.should_log, which the Trainer set for its own entry of this step: put it back, or
        # the Trainer would skip (and later average over) the loss it logs at this step
        should_log = self.trainer.control.should_log
        # The base class's log: a subclass's (TRL's) merges the metrics it gathered since its last entry into any entry
        # and clears them, so they would move from the Trainer's own entry of this step into gradwatch's.
        Trainer.log(self.trainer, cast(dict[str, float], values))
        self.trainer.control.should_log = should_log

    def flush(self) -> None:
        """Log the values held back for the step that just ended."""
        pending, self.pending = self.pending, []
        for values in pending:
            self(values, self.trainer.state.global_step)
