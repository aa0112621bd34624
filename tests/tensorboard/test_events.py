"""Reading gradwatch's results back from event files: a real run round-trips, bad input raises clear errors."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
from helpers import LitSeedModel, loader, seed_batch, trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.tensorboard import SummaryWriter

from gradwatch import GradWatch
from gradwatch.tensorboard.events import (
    EventFilesError,
    event_files,
    parse_failures_table,
    read_logdir,
    verify_event_file,
)


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GradWatch]:
    logdir = tmp_path_factory.mktemp("events")
    watch = GradWatch(every_n_steps=2, max_overhead=None, on_fail=lambda report: None)
    logger = TensorBoardLogger(str(logdir), name="seed", default_hp_metric=False)
    trainer(logdir, [watch], logger=logger, max_steps=4).fit(LitSeedModel(weight_scale=1.1), loader(seed_batch(), 4))
    return logdir, watch


@pytest.mark.slow
def test_a_real_run_reads_back_check_by_check(failing_run: tuple[Path, GradWatch]) -> None:
    logdir, watch = failing_run
    (run,) = read_logdir(logdir)
    assert run.name == "seed/version_0"
    assert run.has_histogram
    assert run.has_dashboard
    assert [c.step for c in run.checks] == [r.step for r in watch.recomputed_reports] == [1, 2, 4]
    assert [c.verdict for c in run.checks] == [r.verdict for r in watch.recomputed_reports] == ["fail"] * 3
    for check, report in zip(run.checks, watch.recomputed_reports, strict=True):
        for tag, value in report.scalars().items():
            assert check.scalars[tag] == pytest.approx(value, rel=1e-6), tag  # logged as float32
    assert run.failed


@pytest.mark.slow
def test_every_failing_probe_reads_back_with_step_tensor_index_and_both_values(
    failing_run: tuple[Path, GradWatch],
) -> None:
    logdir, watch = failing_run
    (run,) = read_logdir(logdir)
    expected = [(r.step, p) for r in watch.recomputed_reports for p in r.failures]
    assert len(run.failures) == len(expected) > 0
    for record, (step, probe) in zip(run.failures, expected, strict=True):
        assert (record.step, record.kind, record.tensor) == (step, probe.kind, probe.target)
        assert record.location == probe.location
        assert record.analytic == pytest.approx(probe.analytic, rel=1e-5)  # the table keeps 6 significant digits
        assert record.numeric == pytest.approx(probe.numeric, rel=1e-5)
        assert record.rel_error == pytest.approx(probe.rel_error, rel=1e-2)


def test_failures_table_columns_are_found_by_header() -> None:
    text = "\n".join(
        [
            "gradient check **failed** at step 3: 1 of 9 probes",
            "",
            "| tensor | kind | extra | index | numeric | analytic |",
            "|:---|---|---|---:|---:|---:|",
            "| `a.weight` | param | x | 1, 2 | 2.5 | -1e-07 |",
        ]
    )
    (record,) = parse_failures_table(text, step=3)
    assert (record.tensor, record.kind, record.index, record.analytic, record.numeric) == (
        "a.weight",
        "param",
        "1, 2",
        -1e-07,
        2.5,
    )
    assert math.isnan(record.rel_error)
    with pytest.raises(EventFilesError, match=r"unreadable row .* at step 3"):
        parse_failures_table("| kind | tensor | index | analytic | numeric |\n|---|---|---|---|---|\n| param | w |", 3)


def test_missing_and_empty_directories_are_named(tmp_path: Path) -> None:
    with pytest.raises(EventFilesError, match=r"log directory .*nowhere does not exist"):
        read_logdir(tmp_path / "nowhere")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(EventFilesError, match=r"no TensorBoard event files \(events\.out\.tfevents\.\*\) under"):
        read_logdir(tmp_path / "empty")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(EventFilesError, match="is not a directory"):
        read_logdir(tmp_path / "file.txt")


def test_event_files_without_gradwatch_data_are_refused(tmp_path: Path) -> None:
    writer = SummaryWriter(str(tmp_path / "other"))
    writer.add_scalar("train_loss", 1.0, 1)
    writer.close()
    with pytest.raises(EventFilesError, match=r"no check was recorded under .*hold no 'gradwatch/verdict' scalar"):
        read_logdir(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped_byte", "truncated", "garbage"])
def test_corrupt_event_files_are_refused(failing_run: tuple[Path, GradWatch], tmp_path: Path, damage: str) -> None:
    (source,) = event_files(failing_run[0])
    data = bytearray(source.read_bytes())
    if damage == "flipped_byte":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncated":
        data = data[: len(data) - 7]
    else:
        data = bytearray(b"not an event file at all")
    broken = tmp_path / "run" / source.name
    broken.parent.mkdir()
    broken.write_bytes(bytes(data))
    reason = r"(damaged|truncated) record|past the end of the file|checksum mismatch"
    with pytest.raises(EventFilesError, match=rf"corrupt event file {re.escape(str(broken))}: .*({reason})"):
        read_logdir(tmp_path)
    verify_event_file(source)  # the intact original reads to its end


@pytest.mark.slow
def test_several_runs_are_found_and_sorted(failing_run: tuple[Path, GradWatch], tmp_path: Path) -> None:
    for name in ("b", "a"):
        shutil.copytree(failing_run[0], tmp_path / name)
    assert [run.name for run in read_logdir(tmp_path)] == ["a/seed/version_0", "b/seed/version_0"]
