"""Where a Hugging Face ``Trainer`` run's gradwatch records go: the sinks :class:`~gradwatch.integrations.huggingface.
GradWatchCallback` gives the watch once per run, found from the Trainer's own ``report_to`` integrations.

* every process: the scalars through ``trainer.log`` (:class:`~gradwatch.outputs.sinks.LogCallSink`), which reaches
  every integration and keeps each process's log history;
* the main process: what each ``report_to`` integration shows besides scalars and the JSON lines record beside its
  run (:mod:`gradwatch.integrations.loggers`): in a TensorBoard run, the histogram and the failure text beside the
  Trainer's ``train/...`` tags (the scalars reach it through ``trainer.log``) and the record in its directory; for a
  Weights & Biases or MLflow run, the record in ``<output_dir>/gradwatch_records/<callback>-<run id>``; otherwise in
  ``output_dir``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from transformers import Trainer, TrainerState, TrainingArguments

from gradwatch.integrations.loggers import logger_sinks, trainer_runs
from gradwatch.outputs.sinks import LogCallSink, Sink
from gradwatch.tensorboard.writer import TRAINER_PREFIX

__all__ = ["TrainerLog", "run_sinks"]


def run_sinks(
    trainer: Trainer, args: TrainingArguments, state: TrainerState, log: Callable[[dict[str, float | str], int], object]
) -> list[Sink]:
    """The sinks of one run (see the module's docstring); ``log(values, step)`` sends values through ``trainer.log``."""
    sinks: list[Sink] = [LogCallSink(log)]
    if state.is_world_process_zero:
        sinks += logger_sinks(trainer_runs(trainer, args), prefix=TRAINER_PREFIX)
    return sinks


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
