"""End to end: a fault on the training's path only (a backward wrong under bf16 autocast alone), caught by an applied
check in a Lightning fit, then ``python -m gradwatch report`` on the run's directory, from the JSON lines record of a
CSV-only run and from the event files of a TensorBoard run: exit status 1, the fault first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from applied_models import MLP, batch_for, cross_entropy
from helpers import trainer

from gradwatch import GradientCheckWarning, GradWatch
from gradwatch.outputs import JSONL_NAME

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


class _Lit(pl.LightningModule):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return cross_entropy(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(tmp_path: Path, logger: pl.loggers.Logger) -> GradWatch:
    torch.manual_seed(0)
    net = MLP(autocast_fault=1.5)
    x, y = zip(*(batch_for(net, seed=seed) for seed in range(2)), strict=True)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(x), torch.cat(y)), batch_size=16)
    watch = GradWatch(every_n_steps=1000, applied_every_n_steps=1, max_overhead=None)
    with pytest.warns(GradientCheckWarning, match="precision fault"):
        trainer(tmp_path, [watch], logger=logger, precision="bf16-mixed", max_steps=2).fit(_Lit(net), loader)
    return watch


def _gradwatch_report(logdir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    command = [sys.executable, "-m", "gradwatch", "report", str(logdir)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def _assert_precision_fault_reported(done: subprocess.CompletedProcess[str], watch: GradWatch) -> None:
    first = watch.applied_reports[0]
    assert (first.step, first.verdict, first.fault) == (1, "fail", "precision")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"precision fault at step 1: {first.fault_message}" in done.stdout
    assert "result: FAIL" in done.stdout


def test_a_csv_only_run_reports_the_applied_fault_from_its_json_lines_record(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path), name="csv")
    watch = _fit(tmp_path, logger)
    assert (Path(logger.log_dir) / JSONL_NAME).is_file()
    _assert_precision_fault_reported(_gradwatch_report(tmp_path / "csv"), watch)


def test_a_tensorboard_run_reports_the_applied_fault_from_the_record_beside_its_event_files(tmp_path: Path) -> None:
    logger = TensorBoardLogger(str(tmp_path), name="tb", default_hp_metric=False)
    watch = _fit(tmp_path, logger)
    assert (Path(logger.log_dir) / JSONL_NAME).is_file()  # gradwatch report reads it, not the event files
    _assert_precision_fault_reported(_gradwatch_report(tmp_path / "tb"), watch)
