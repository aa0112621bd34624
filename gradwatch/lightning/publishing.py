"""Where a check's report goes in a Lightning run: the trainer's loggers (scalars, and for TensorBoard the histogram,
the failure table and the dashboard layout), and the progress bar."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

from gradwatch.engine.report import CheckReport
from gradwatch.tensorboard.dashboard import write_dashboard
from gradwatch.tensorboard.writer import write_report

PROGRESS_BAR_KEY = "gradwatch"


def publish(trainer: pl.Trainer, report: CheckReport, overhead: float) -> None:
    """Send the report's scalars (and ``gradwatch/overhead``) to every logger at the trainer's step; with a
    TensorBoard logger on rank 0, its histogram and failure table too, flushed at once when the check failed."""
    scalars = {**report.scalars(), "gradwatch/overhead": overhead}
    metrics = {tag: value for tag, value in scalars.items() if value == value}  # drop NaN
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
        if isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
            write_report(logger.experiment, report, trainer.global_step)
            if report.verdict == "fail":
                logger.experiment.flush()


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
