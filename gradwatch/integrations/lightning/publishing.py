"""Where a check's report goes in a Lightning run: every logger, ``trainer.callback_metrics`` and the progress bar.

The report becomes records once (:func:`gradwatch.outputs.records_of`), and each logger gets what it can show:

* every logger: the ``gradwatch/*`` scalars through ``log_metrics`` (at the trainer's step);
* ``trainer.callback_metrics``: the same scalars, so ``EarlyStopping(monitor="gradwatch/verdict")`` or a
  ``ModelCheckpoint`` can act on them (every rank: the ranks agree on the report);
* TensorBoard: the histogram of log10 relative errors and the failure text (:class:`SummaryWriterSink`) and, once,
  the dashboard's layout;
* loggers with text support, found by what they offer, not by importing their libraries: Weights & Biases
  (``log_text``) and MLflow (``experiment.log_text``) get the failure text with the culprit;
* every logger's run directory (``log_dir``; for loggers without one, such as W&B and MLflow,
  ``<default_root_dir>/gradwatch_records/<logger>-<name>-<version>``): the JSON lines record, ``gradwatch.jsonl``
  (:class:`JsonLinesSink`), which ``gradwatch report`` reads, CSV runs included.

Applied checks (``report.scope == "applied"``) go the same way, their records from
:func:`gradwatch.outputs.records.applied_records_of`: ``gradwatch/applied/*`` scalars and their text, led by the fault,
under ``gradwatch/applied/failure``. The sinks are built once per run (:class:`TrainerSink` on every rank, the others
on rank 0: files and texts are written there only). A logger that cannot show the
failure text or the histograms gets one info record per run naming where they are instead, never silence.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger, TensorBoardLogger

from gradwatch.engine.results.report import CheckReport
from gradwatch.outputs.beside import record_directory
from gradwatch.outputs.jsonl import JSONL_NAME
from gradwatch.outputs.records import CheckRecords
from gradwatch.outputs.sinks import JsonLinesSink, Sink, SummaryWriterSink, TextSink
from gradwatch.tensorboard.dashboard import write_dashboard

log = logging.getLogger(__name__)

PROGRESS_BAR_KEY = "gradwatch"

_noted: weakref.WeakSet[Logger] = weakref.WeakSet()
"""Loggers already told what they cannot show (once per logger object, so once per run)."""


class TrainerSink:
    """The scalars of every check to every logger of the trainer (``log_metrics`` at the check's step) and into
    ``trainer.callback_metrics`` (every rank: the ranks agree on the report)."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer

    def write(self, records: CheckRecords) -> None:
        for logger in self.trainer.loggers:
            logger.log_metrics(records.scalars, step=records.step)
        feed_callback_metrics(self.trainer, records)

    def flush(self) -> None:
        """Nothing to do: each logger flushes as it is configured to."""


def feed_callback_metrics(trainer: pl.Trainer, records: CheckRecords) -> None:
    """The scalars as tensors in ``trainer.callback_metrics`` (what ``EarlyStopping`` and ``ModelCheckpoint``
    monitor), as ``LearningRateMonitor`` does."""
    device = trainer.strategy.root_device
    trainer.callback_metrics.update({tag: torch.tensor(value, device=device) for tag, value in records.scalars.items()})


def _directory(trainer: pl.Trainer, logger: Logger) -> Path:
    """Where the logger's run keeps the JSON lines record: the run's own directory (``log_dir``: CSV, TensorBoard);
    for a logger without one (W&B and MLflow share a ``save_dir`` among runs), a directory of its own for this run
    under the trainer's ``default_root_dir``, ``gradwatch_records/<logger>-<name>-<version>``."""
    log_dir = getattr(logger, "log_dir", None)
    if isinstance(log_dir, (str, Path)) and str(log_dir):
        return Path(log_dir)
    run = f"{type(logger).__name__}-{logger.name}"
    return record_directory(Path(trainer.default_root_dir), run, str(logger.version))


def _text_call(logger: Logger) -> Callable[[str, str, int], object] | None:
    """The logger's own way to show a text, if it has one (duck-typed: no import of wandb or mlflow)."""
    if isinstance(logger, TensorBoardLogger):
        return None  # its SummaryWriterSink writes the text
    log_text = getattr(logger, "log_text", None)
    if callable(log_text):  # WandbLogger: a one-row table
        return lambda tag, text, step: log_text(key=tag, columns=["step", "failures"], data=[[step, text]], step=step)
    if hasattr(type(logger), "run_id"):  # MLFlowLogger: a markdown artifact per failing check
        client_log_text = getattr(getattr(logger, "experiment", None), "log_text", None)
        if callable(client_log_text):
            run_id = logger.run_id  # type: ignore[attr-defined]
            return lambda tag, text, step: client_log_text(run_id, text, f"{tag}/step_{step}.md")
    return None


def _note_once(logger: Logger, missing: list[str], record: Path) -> None:
    if logger in _noted or not missing:
        return
    _noted.add(logger)
    log.info(
        "gradwatch: %s gets gradwatch's scalars but cannot show %s; every check is recorded in %s (read it with "
        "`gradwatch report %s`)",
        type(logger).__name__,
        " or ".join(missing),
        record,
        record.parent,
    )


def sinks(trainer: pl.Trainer) -> list[Sink]:
    """The sinks of the trainer's loggers on rank 0 (none elsewhere): one per backend that shows more than scalars,
    and one JSON lines record per log directory."""
    if not trainer.is_global_zero:
        return []
    found: list[Sink] = []
    records: dict[Path, JsonLinesSink] = {}
    for logger in trainer.loggers:
        record = _directory(trainer, logger) / JSONL_NAME
        records.setdefault(record, JsonLinesSink(record))
        missing = []
        if isinstance(logger, TensorBoardLogger):
            found.append(SummaryWriterSink(logger.experiment, scalars=False))
        else:
            missing.append("histograms")
            text = _text_call(logger)
            if text is None:
                missing.insert(0, "the failure text")
            else:
                found.append(TextSink(text))
        _note_once(logger, missing, record)
    return found + list(records.values())


def publish_dashboard(trainer: pl.Trainer) -> None:
    """Write the dashboard's layout into each TensorBoard run, once, before any check (rank 0)."""
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                write_dashboard(logger.experiment)


def show_in_progress_bar(trainer: pl.Trainer, report: CheckReport, failed_checks: int) -> None:
    """Show the last verdict among the progress bar's metrics, e.g. ``gradwatch=fail@1``."""
    if trainer.progress_bar_callback is None or not trainer.is_global_zero:
        return
    # Progress bars show every entry of this dict, strings included; self.log(prog_bar=True) takes numbers only.
    # Lightning updates the dict in place and clears it only when a fit or its sanity check starts.
    metrics: dict[str, Any] = trainer.progress_bar_metrics
    metrics[PROGRESS_BAR_KEY] = progress_status(report, failed_checks)


def progress_status(report: CheckReport, failed_checks: int) -> str:
    """A short status for the progress bar: the last verdict and its step, plus the failed checks so far when the last
    one did not fail (``"ok@500 (2 failed)"``)."""
    status = f"{report.verdict}@{report.step}"
    if failed_checks and report.verdict != "fail":
        status += f" ({failed_checks} failed)"
    return status
