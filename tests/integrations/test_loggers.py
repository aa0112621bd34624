"""One logger discovery for both adapters (``gradwatch.integrations.loggers``): a Lightning trainer's loggers and a
Hugging Face Trainer's integration callbacks give the same kinds of sink, with ``gradwatch.jsonl`` beside each run."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from gradwatch.integrations.loggers import lightning_runs, logger_sinks, trainer_runs
from gradwatch.outputs.sinks import JsonLinesSink, SummaryWriterSink, TextSink


class WandbLike:
    """What is read of Lightning's WandbLogger: no ``log_dir``, a ``log_text``."""

    name, version = "project", "abc123"

    def __init__(self) -> None:
        self.texts: list[tuple[str, Any]] = []

    def log_text(self, key: str, columns: list[str], data: list[list[Any]], step: int) -> None:
        self.texts.append((key, data))


def _kinds(sinks: list[Any]) -> list[str]:
    return [type(sink).__name__ for sink in sinks]


def test_a_lightning_trainers_loggers_get_their_sinks_and_a_record_in_each_run_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    board = TensorBoardLogger(str(tmp_path), name="tb", default_hp_metric=False)
    csv, wandb = CSVLogger(str(tmp_path), name="csv"), WandbLike()
    trainer = SimpleNamespace(loggers=[board, csv, wandb], default_root_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="gradwatch.integrations.loggers"):
        sinks = logger_sinks(lightning_runs(trainer), note=True)
    assert _kinds(sinks) == ["SummaryWriterSink", "TextSink", "JsonLinesSink", "JsonLinesSink", "JsonLinesSink"]
    assert [sink.path for sink in sinks if isinstance(sink, JsonLinesSink)] == [
        Path(board.log_dir) / "gradwatch.jsonl",
        Path(csv.log_dir) / "gradwatch.jsonl",
        tmp_path / "gradwatch_records" / "WandbLike-project-abc123" / "gradwatch.jsonl",
    ]
    text = next(sink for sink in sinks if isinstance(sink, TextSink))
    text.log_text("gradwatch/failures", "fc2 is wrong", 3)
    assert wandb.texts == [("gradwatch/failures", [[3, "fc2 is wrong"]])]
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 2, said  # TensorBoard shows all: nothing said of it
    assert "CSVLogger" in said[0]
    assert "cannot show the failure text or histograms" in said[0]
    assert "WandbLike" in said[1]
    assert "cannot show histograms" in said[1]


def test_a_hugging_face_trainers_integrations_get_the_same_sinks(tmp_path: Path) -> None:
    writer = SimpleNamespace(log_dir=str(tmp_path / "runs" / "now"))
    callbacks = [
        SimpleNamespace(),  # a callback that logs nothing (the progress bar's)
        SimpleNamespace(tb_writer=writer),  # TensorBoardCallback
        SimpleNamespace(_wandb=SimpleNamespace(run=SimpleNamespace(id="abc123de"))),  # WandbCallback, started
        SimpleNamespace(_wandb=SimpleNamespace(run=None)),  # WandbCallback, no run yet: nothing of its own
    ]
    trainer = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=callbacks))
    args = SimpleNamespace(output_dir=str(tmp_path), logging_dir=None)
    sinks = logger_sinks(trainer_runs(trainer, args), prefix="train/")
    assert _kinds(sinks) == ["SummaryWriterSink", "JsonLinesSink", "JsonLinesSink"]
    assert isinstance(sinks[0], SummaryWriterSink)
    assert [sink.path for sink in sinks[1:]] == [  # type: ignore[attr-defined]
        tmp_path / "runs" / "now" / "gradwatch.jsonl",
        tmp_path / "gradwatch_records" / "SimpleNamespace-abc123de" / "gradwatch.jsonl",
    ]
    alone = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[SimpleNamespace()]))
    assert [sink.path for sink in logger_sinks(trainer_runs(alone, args))] == [  # type: ignore[attr-defined]
        tmp_path / "gradwatch.jsonl"  # no logger with a run: the output directory
    ]
