"""The loggers of a run, for both adapters: what each shows of a check besides scalars (which reach every logger
through the loop's own log call), where its run keeps ``gradwatch.jsonl``, and the sinks they get on the main process.
Found by what they offer, without importing wandb, mlflow or transformers: a TensorBoard run gets the histogram and the
failure text through its ``SummaryWriter`` and the record in its directory; any logger with a ``log_dir`` (Lightning's
CSV logger) the record there; W&B and MLflow, whose run folders gradwatch does not write into, the failure text through
their own call (under Lightning) and the record beside their run (:mod:`gradwatch.outputs.beside`). A new logger is a
branch of :func:`lightning_runs` or :func:`trainer_runs`.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradwatch.outputs.beside import record_directory
from gradwatch.outputs.jsonl import JSONL_NAME
from gradwatch.outputs.sinks import JsonLinesSink, Sink, SummaryWriterSink, TextSink

__all__ = ["LoggerRun", "lightning_runs", "logger_sinks", "tracking_run_id", "trainer_runs"]

log = logging.getLogger(__name__)

TextCall = Callable[[str, str, int], object]  # text(tag, text, step): a logger's own way to show a text

_noted: weakref.WeakSet[Any] = weakref.WeakSet()
"""Loggers already told what they cannot show (once per logger object, so once per run)."""


@dataclass(frozen=True)
class LoggerRun:
    """What one logger of a run offers a check's records."""

    logger: Any
    """The logger (or the Trainer's integration callback)."""
    directory: Path | None
    """Where its run's ``gradwatch.jsonl`` goes."""
    writer: Any = None
    """Its TensorBoard ``SummaryWriter``, if it is one."""
    text: TextCall | None = None
    """Its own call to show the failure text, if it has one (and no writer)."""


def logger_sinks(runs: Sequence[LoggerRun], *, prefix: str = "", note: bool = False) -> list[Sink]:
    """The sinks of the loggers ``runs``: one per logger that shows more than scalars (its tags under ``prefix``),
    then one JSON lines record per run directory. ``note``: tell each logger once (INFO) what it cannot show and
    where the record is instead."""
    found: list[Sink] = []
    records: dict[Path, JsonLinesSink] = {}
    for run in runs:
        if run.writer is not None:
            found.append(SummaryWriterSink(run.writer, scalars=False, prefix=prefix))
        elif run.text is not None:
            found.append(TextSink(run.text))
        if run.directory is None:
            continue
        record = run.directory / JSONL_NAME
        records.setdefault(record, JsonLinesSink(record))
        if note and run.writer is None and run.logger not in _noted:
            _noted.add(run.logger)
            missing = "histograms" if run.text is not None else "the failure text or histograms"
            log.info(
                "gradwatch: %s gets gradwatch's scalars but cannot show %s; every check is recorded in %s (read it "
                "with `gradwatch report %s`)",
                type(run.logger).__name__,
                missing,
                record,
                record.parent,
            )
    return found + list(records.values())


def lightning_runs(trainer: Any) -> list[LoggerRun]:
    """The loggers of a Lightning ``Trainer`` (``trainer.loggers``); a logger without a run directory of its own (W&B
    and MLflow share a ``save_dir`` among runs) gets ``gradwatch_records/<logger>-<name>-<version>`` under the
    trainer's ``default_root_dir``."""
    from lightning.pytorch.loggers import TensorBoardLogger  # the Lightning adapter's, which has Lightning

    runs = []
    for logger in trainer.loggers:
        log_dir = getattr(logger, "log_dir", None)
        if isinstance(log_dir, (str, Path)) and str(log_dir):
            directory = Path(log_dir)
        else:
            run = f"{type(logger).__name__}-{logger.name}"
            directory = record_directory(Path(trainer.default_root_dir), run, str(logger.version))
        if isinstance(logger, TensorBoardLogger):
            runs.append(LoggerRun(logger, directory, writer=logger.experiment))
        else:
            runs.append(LoggerRun(logger, directory, text=_text_call(logger)))
    return runs


def _text_call(logger: Any) -> TextCall | None:
    """A Lightning logger's own way to show a text, if it has one."""
    log_text = getattr(logger, "log_text", None)
    if callable(log_text):  # WandbLogger: a one-row table
        return lambda tag, text, step: log_text(key=tag, columns=["step", "failures"], data=[[step, text]], step=step)
    if hasattr(type(logger), "run_id"):  # MLFlowLogger: a markdown artifact per failing check
        client_log_text = getattr(getattr(logger, "experiment", None), "log_text", None)
        if callable(client_log_text):
            run_id = logger.run_id
            return lambda tag, text, step: client_log_text(run_id, text, f"{tag}/step_{step}.md")
    return None


def trainer_runs(trainer: Any, args: Any) -> list[LoggerRun]:
    """The loggers of a Hugging Face ``Trainer`` (its integration callbacks): its TensorBoard run, then a run beside
    each Weights & Biases or MLflow run under ``output_dir``; without any of these, ``output_dir`` (its
    ``logging_dir`` if set) as the one place of the record."""
    root = Path(args.output_dir or ".")
    callbacks = trainer.callback_handler.callbacks
    runs = []
    board = next((c for c in callbacks if hasattr(c, "tb_writer")), None)  # TensorBoardCallback
    if board is not None:
        writer = board.tb_writer
        directory = getattr(writer, "log_dir", None) or getattr(board, "logging_dir", None)
        runs.append(LoggerRun(board, Path(directory) if directory else None, writer=writer))
    for callback in callbacks:
        run_id = tracking_run_id(callback)
        if run_id:
            runs.append(LoggerRun(callback, record_directory(root, type(callback).__name__, run_id)))
    if not any(run.directory is not None for run in runs):
        runs.append(LoggerRun(None, Path(getattr(args, "logging_dir", None) or root)))
    return runs


def tracking_run_id(callback: Any) -> str | None:
    """The run id of a Weights & Biases or MLflow integration callback once its run started, else ``None`` (read from
    the objects they keep: ``_wandb.run.id``, ``_ml_flow.active_run().info.run_id``)."""
    try:
        wandb = getattr(callback, "_wandb", None)
        if wandb is not None:
            run = getattr(wandb, "run", None)
            return None if run is None else str(run.id)
        active = getattr(callback, "_ml_flow", None)
        run = active.active_run() if active is not None else None
        return None if run is None else str(run.info.run_id)
    except Exception:  # a tracking tool's state must not end the run: its record then goes to output_dir
        return None
