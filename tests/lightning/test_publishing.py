"""Publishing in a Lightning run: scalars to every logger and to callback_metrics, the failure text to loggers that
show text, the JSON lines record in every logger's directory, one note for what a logger cannot show."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
from helpers import LitSeedModel, loader, seed_batch, trainer
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

from gradwatch import GradientCheckWarning, GradWatch
from gradwatch.outputs.jsonl import JSONL_NAME
from gradwatch.tensorboard.writer import APPLIED_FAILURE_TAG, FAILURES_TAG

pytestmark = pytest.mark.slow


class _Quiet(Logger):
    """A logger that keeps what it is given (the base of the fakes below)."""

    def __init__(self, save_dir: Path | None = None) -> None:
        super().__init__()
        self._save_dir = None if save_dir is None else str(save_dir)
        self.metrics: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def version(self) -> int:
        return 0

    @property
    def save_dir(self) -> str | None:
        return self._save_dir

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class WandbLike(_Quiet):
    """What gradwatch uses of Lightning's WandbLogger: ``log_text(key, columns, data, step)``."""

    def __init__(self, save_dir: Path | None = None) -> None:
        super().__init__(save_dir)
        self.texts: list[dict[str, Any]] = []

    def log_text(self, key: str, columns: list[str], data: list[list[Any]], step: int | None = None) -> None:
        self.texts.append({"key": key, "columns": columns, "data": data, "step": step})


class MlflowClientLike:
    def __init__(self) -> None:
        self.texts: list[tuple[str, str, str]] = []

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.texts.append((run_id, text, artifact_file))


class MlflowLike(_Quiet):
    """What gradwatch uses of Lightning's MLFlowLogger: ``run_id`` and ``experiment.log_text``."""

    def __init__(self, save_dir: Path | None = None) -> None:
        super().__init__(save_dir)
        self.client = MlflowClientLike()

    @property
    def run_id(self) -> str:
        return "run-7"

    @property
    def experiment(self) -> MlflowClientLike:
        return self.client


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One failing fit with four loggers: CSV, TensorBoard, a W&B-like one (no directory) and an MLflow-like one."""
    tmp = tmp_path_factory.mktemp("publishing")
    loggers = {
        "csv": CSVLogger(str(tmp), name="csv"),
        "tb": TensorBoardLogger(str(tmp), name="tb", default_hp_metric=False),
        "wandb": WandbLike(),
        "mlflow": MlflowLike(tmp / "mlruns"),
    }
    watch = GradWatch(every_n_steps=2, max_overhead=None)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    publishing_log = logging.getLogger("gradwatch.integrations.loggers")
    publishing_log.addHandler(handler)
    publishing_log.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GradientCheckWarning)
            fit = trainer(tmp, [watch], logger=list(loggers.values()), max_steps=4)
            fit.fit(LitSeedModel(weight_scale=1.1), loader(seed_batch(), 4))
    finally:
        publishing_log.removeHandler(handler)
    return {"tmp": tmp, "loggers": loggers, "watch": watch, "notes": records, "trainer": fit}


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _of(lines: list[dict[str, Any]], scope: str) -> list[dict[str, Any]]:
    return [line for line in lines if line.get("scope", "recomputed") == scope]


def test_every_logger_directory_gets_the_json_lines_record(run: dict[str, Any]) -> None:
    loggers, steps = run["loggers"], [r.step for r in run["watch"].recomputed_reports]
    directories = [
        Path(loggers["csv"].log_dir),
        Path(loggers["tb"].log_dir),
        # loggers without a run directory of their own: one per logger and run under the trainer's root
        run["tmp"] / "gradwatch_records" / "WandbLike-WandbLike-0",
        run["tmp"] / "gradwatch_records" / "MlflowLike-MlflowLike-0",
    ]
    applied = [r.step for r in run["watch"].applied_reports]
    assert applied == [1]  # the applied check at the first check step (its cadence is far longer)
    for directory in directories:
        lines = _lines(directory / JSONL_NAME)
        assert [line["step"] for line in _of(lines, "recomputed")] == steps == [1, 2, 4], directory
        assert [line["step"] for line in _of(lines, "applied")] == applied, directory
        # the update the optimizer made from the verified (wrong) gradient is the right update of that gradient
        assert [(line["step"], line["verdict"]) for line in _of(lines, "update")] == [(1, "ok")], directory
    lines = [line for line in _lines(directories[0] / JSONL_NAME) if line.get("scope") != "update"]
    assert all(line["verdict"] == "fail" and line["failures"] for line in lines)
    # the wrong weight is wrong on every path: the applied check names a formula fault
    assert [(line["fault"], bool(line["fault_message"])) for line in lines if line["scope"] == "applied"] == [
        ("formula", True)
    ]


def test_scalars_reach_every_logger_and_callback_metrics(run: dict[str, Any]) -> None:
    for name in ("wandb", "mlflow"):
        logged = [(step, metrics) for step, metrics in run["loggers"][name].metrics if "gradwatch/verdict" in metrics]
        assert [step for step, _ in logged] == [1, 2, 4]
        assert logged[0][1]["gradwatch/rel_error_max_log10"] > -2
    metrics = run["trainer"].callback_metrics
    assert float(metrics["gradwatch/verdict"]) == 2.0
    assert float(metrics["gradwatch/failing_probes"]) == run["watch"].recomputed_reports[-1].count("fail")


def test_loggers_with_text_support_get_the_failure_text(run: dict[str, Any]) -> None:
    texts = run["loggers"]["wandb"].texts
    recomputed = [t for t in texts if t["key"] == FAILURES_TAG]
    assert [(t["step"], t["columns"]) for t in recomputed] == [(s, ["step", "failures"]) for s in (1, 2, 4)]
    assert "| tensor | `net.fc.weight` |" in recomputed[0]["data"][0][1]
    # the failing applied check's text, under its own tag, led by its fault
    (applied,) = [t for t in texts if t["key"] == APPLIED_FAILURE_TAG]
    assert applied["step"] == 1
    assert applied["data"][0][1].startswith("formula fault: applied gradient check failed at step 1: ")
    mlflow = run["loggers"]["mlflow"].client.texts
    assert sorted(artifact for run_id, _, artifact in mlflow if run_id == "run-7") == sorted(
        [f"{FAILURES_TAG}/step_{s}.md" for s in (1, 2, 4)]
        + [f"{APPLIED_FAILURE_TAG}/step_1.md", "gradwatch/applied/fault_name/step_1.md"]  # the fault in words too
    )


def test_what_a_logger_cannot_show_is_said_once_per_logger(run: dict[str, Any]) -> None:
    messages = [record.getMessage() for record in run["notes"] if record.levelno == logging.INFO]
    csv_notes = [m for m in messages if m.startswith("gradwatch: CSVLogger")]
    assert len(csv_notes) == 1
    assert "cannot show the failure text or histograms" in csv_notes[0]
    assert str(Path(run["loggers"]["csv"].log_dir) / JSONL_NAME) in csv_notes[0]
    assert sum(m.startswith("gradwatch: WandbLike") for m in messages) == 1
    assert "cannot show histograms" in next(m for m in messages if m.startswith("gradwatch: WandbLike"))
    assert not any("TensorBoardLogger" in m for m in messages)


def test_early_stopping_can_monitor_the_verdict(tmp_path: Path) -> None:
    # the verdict of a failing check is 2: above the divergence threshold, the first epoch's end stops the fit
    stop = EarlyStopping(
        monitor="gradwatch/verdict", mode="min", divergence_threshold=1.5, check_on_train_epoch_end=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradientCheckWarning)
        fit = trainer(tmp_path, [GradWatch(every_n_steps=2, max_overhead=None), stop], max_steps=-1, max_epochs=3)
        fit.fit(LitSeedModel(weight_scale=1.1), loader(seed_batch(), 4))
    assert fit.global_step == 4  # one epoch of four batches, not three
    assert stop.stopped_epoch == 0


def test_gradwatch_report_reads_every_loggers_record(run: dict[str, Any]) -> None:
    from gradwatch.outputs.reading import read_logdir

    runs = {found.name: found for found in read_logdir(run["tmp"])}
    assert sorted(runs) == [
        "csv/version_0",
        "gradwatch_records/MlflowLike-MlflowLike-0",
        "gradwatch_records/WandbLike-WandbLike-0",
        "tb/version_0",
    ]
    assert all([c.step for c in found.checks] == [1, 2, 4] and found.failed for found in runs.values())
    assert all(found.failures == runs["tb/version_0"].failures != [] for found in runs.values())  # one record each
