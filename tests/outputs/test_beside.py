"""``gradwatch report`` on every run a user points it at: a Weights & Biases or MLflow run folder (the record sits
beside it, in ``gradwatch_records``), a Hugging Face Trainer's TensorBoard run (the record beside its ``train/...``
tags), and errors that say what was found instead of gradwatch data. The tools' folder layouts are reproduced as
they lay them out."""

from __future__ import annotations

import contextlib
import dataclasses
import io
from pathlib import Path

import pytest
from helpers import SeedModel, seed_batch, seed_loss
from torch.utils.tensorboard import SummaryWriter

from gradwatch import check_gradients
from gradwatch.cli import main
from gradwatch.engine.results.report import CheckReport
from gradwatch.outputs import JsonLinesSink, SummaryWriterSink, records_of
from gradwatch.outputs.beside import record_directory, tool_runs
from gradwatch.tensorboard.writer import TRAINER_PREFIX

pytestmark = pytest.mark.slow

WANDB_ID = "abc123de"
MLFLOW_ID = "0123456789abcdef0123456789abcdef"
CULPRIT = "the backward of `fc` is wrong"


@pytest.fixture(scope="module")
def failing() -> CheckReport:
    report = check_gradients(SeedModel(weight_scale=1.1), seed_batch(), seed_loss, step=4)
    assert report.verdict == "fail"
    return dataclasses.replace(report, culprit_message=CULPRIT, culprits=["fc", ""])


def _report(path: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["report", str(path)])
    return code, out.getvalue(), err.getvalue()


def _wandb_run(root: Path, offline: bool = False, run_id: str = WANDB_ID) -> Path:
    """``<root>/wandb/run-<time>-<id>`` as W&B lays it out (with its ``latest-run`` link)."""
    run = root / "wandb" / f"{'offline-' if offline else ''}run-20261126_160000-{run_id}"
    (run / "files").mkdir(parents=True)
    (run / "files" / "config.yaml").write_text("_wandb:\n  value: {}\n")
    (run / "logs").mkdir()
    (run / f"run-{run_id}.wandb").write_bytes(b"\x00")
    (root / "wandb" / "latest-run").symlink_to(run.name)
    return run


def _mlflow_run(root: Path) -> Path:
    """``<root>/mlruns/<experiment>/<run id>`` as MLflow's file store lays it out."""
    experiment = root / "mlruns" / "1"
    experiment.mkdir(parents=True)
    (experiment / "meta.yaml").write_text("experiment_id: '1'\nname: exp\n")
    run = experiment / MLFLOW_ID
    for part in ("metrics", "params", "tags", "artifacts"):
        (run / part).mkdir(parents=True)
    (run / "meta.yaml").write_text(f"run_id: {MLFLOW_ID}\n")
    (run / "metrics" / "train_loss").write_text("1700000000000 0.5 1\n")
    return run


@pytest.mark.parametrize(
    ("layout", "root_dir", "logger"),
    [
        ("wandb", ".", "WandbLogger-lightning_logs"),  # Lightning: default_root_dir beside save_dir's wandb/
        ("wandb-offline", "outputs", "WandbCallback"),  # Hugging Face: output_dir beside wandb/
        ("mlflow", ".", "MLFlowLogger-exp"),
        ("mlflow", "outputs", "MLflowCallback"),
    ],
)
def test_a_tracking_tools_run_folder_is_reported_from_the_record_beside_it(
    tmp_path: Path, failing: CheckReport, layout: str, root_dir: str, logger: str
) -> None:
    if layout.startswith("wandb"):
        run, run_id = _wandb_run(tmp_path, offline=layout.endswith("offline")), WANDB_ID
        pointed = [run, tmp_path / "wandb" / "latest-run", tmp_path / "wandb"]
    else:
        run, run_id = _mlflow_run(tmp_path), MLFLOW_ID
        pointed = [run, run.parent, tmp_path / "mlruns"]
    JsonLinesSink(record_directory(tmp_path / root_dir, logger, run_id) / "gradwatch.jsonl").write(records_of(failing))
    for path in pointed:
        assert [r.run_id for r in tool_runs(path)] == [run_id]
        code, out, err = _report(path)
        assert (code, err) == (1, ""), path
        assert f"run {run_id}: 1 checks, steps 4 to 4" in out
        assert f"culprit at step 4: {CULPRIT}" in out


def test_a_run_folder_without_its_record_says_where_it_was_looked_for(tmp_path: Path) -> None:
    run = _wandb_run(tmp_path, run_id="nowhere1")  # an id no other test's folders (searched too) have
    (tmp_path / "gradwatch_records" / "WandbLogger-other-zzz").mkdir(parents=True)  # another run's
    code, out, err = _report(run)
    assert (code, out) == (2, "")
    assert "holds Weights & Biases run nowhere1, whose records sit beside it" in err
    assert "gradwatch_records/<logger>-...-<run id>/gradwatch.jsonl" in err
    assert f"(searched {run.parent} up to " in err
    assert "callbacks" not in err


def test_event_files_without_a_record_say_so(tmp_path: Path) -> None:
    writer = SummaryWriter(str(tmp_path / "runs" / "a"))
    writer.add_scalar("train/gradwatch/verdict", 2.0, 1)
    writer.close()
    code, _, err = _report(tmp_path)
    assert code == 2
    assert f"no gradwatch records under {tmp_path}: no gradwatch.jsonl" in err
    assert "(it holds 1 TensorBoard event file(s), which gradwatch report does not read)" in err


def test_a_record_without_a_check_says_so(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "gradwatch.jsonl").write_text("\n")
    code, _, err = _report(tmp_path)
    assert code == 2
    assert f"no check was recorded under {tmp_path}: its 1 gradwatch.jsonl file(s) hold no check" in err


def test_a_trainers_tensorboard_run_is_read_from_the_record_beside_its_event_files(
    tmp_path: Path, failing: CheckReport
) -> None:
    """The tags as a Hugging Face Trainer's TensorBoardCallback writes them (``rewrite_logs``), the text and the
    histogram as the callback writes them beside, all under ``train/``, and the record in the run's directory
    (:func:`gradwatch.integrations.huggingface.run_sinks`): the report sees the check and its culprit."""
    writer = SummaryWriter(str(tmp_path / "runs" / "Nov26"))
    JsonLinesSink(tmp_path / "runs" / "Nov26" / "gradwatch.jsonl").write(records_of(failing))
    records = records_of(failing)
    for tag, value in records.scalars.items():
        writer.add_scalar(TRAINER_PREFIX + tag, value, records.step)
    writer.add_scalar("train/loss", 1.0, records.step)
    SummaryWriterSink(writer, scalars=False, prefix=TRAINER_PREFIX).write(records)
    writer.close()
    code, out, _ = _report(tmp_path)
    assert code == 1
    assert "== run runs/Nov26: 1 checks, steps 4 to 4: 0 ok, 0 inconclusive, 1 fail; first failure at step 4" in out
    assert f"culprit at step 4: {CULPRIT}" in out
