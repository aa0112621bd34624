"""Where a check's report goes in a Lightning run: every logger, ``trainer.callback_metrics`` and the progress bar.

The report becomes records once (:func:`gradwatch.outputs.records.report_records`), and each logger gets what it can
show: every logger the ``gradwatch/*`` scalars through ``log_metrics``; ``trainer.callback_metrics`` the same scalars,
so ``EarlyStopping(monitor="gradwatch/verdict")`` or a ``ModelCheckpoint`` can act on them (every rank: the ranks agree
on the report); on rank 0, what each logger shows besides scalars (:mod:`gradwatch.integrations.loggers`) and the JSON
lines record in each logger's run directory (for W&B and MLflow, under ``<default_root_dir>/gradwatch_records/``) and,
once, the dashboard's layout in each TensorBoard run. An applied check's records are its ``gradwatch/applied/*``
scalars and its text, led by the fault, under ``gradwatch/applied/failure``. A logger that cannot show the failure text
or the histograms gets one info record per run naming where they are instead.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from gradwatch.engine.results.report import CheckReport
from gradwatch.outputs.records import CheckRecords
from gradwatch.tensorboard.dashboard import write_dashboard

PROGRESS_BAR_KEY = "gradwatch"


class TrainerSink:
    """The scalars of every check to every logger of the trainer (``log_metrics`` at the check's step) and into
    ``trainer.callback_metrics`` (every rank: the ranks agree on the report)."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer

    def write(self, records: CheckRecords) -> None:
        for logger in self.trainer.loggers:
            logger.log_metrics(records.scalars, step=records.step)
        # as tensors in callback_metrics (what EarlyStopping and ModelCheckpoint monitor), as LearningRateMonitor does
        device = self.trainer.strategy.root_device
        metrics = {tag: torch.tensor(value, device=device) for tag, value in records.scalars.items()}
        self.trainer.callback_metrics.update(metrics)

    def flush(self) -> None:
        """Nothing to do: each logger flushes as it is configured to."""


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
