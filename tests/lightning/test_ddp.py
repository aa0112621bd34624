"""GradWatch under real two-process DDP (CPU, gloo): same probes on every rank, rank-0-only logs, agreed decisions.

``strategy="ddp"`` relaunches the running script for rank 1, so the fits run in ``tests/ddp_run.py`` in a subprocess
with a bounded timeout (a hang fails the test instead of blocking the suite); each rank writes what it saw to JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import recomputed_counts
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from two_processes import needs_gloo, run_ranks

from gradwatch.engine.results.notes import NoteCode

pytestmark = [needs_gloo, pytest.mark.slow]


def _run(out: Path, *options: str) -> dict[str, Any]:
    results, _ = run_ranks("ddp_run.py", out, *options, timeout_s=120)
    return {"out": out, **results}


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("ddp"))


def _ranks(ddp: dict[str, Any], scenario: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return ddp[f"{scenario}_rank0"], ddp[f"{scenario}_rank1"]


def test_fit_completes_and_every_rank_probes_the_same_indices(ddp: dict[str, Any]) -> None:
    rank0, rank1 = _ranks(ddp, "healthy")
    assert (rank0["rank"], rank1["rank"]) == (0, 1)
    assert rank0["global_step"] == rank1["global_step"] == 4
    assert rank0["finished"]
    assert rank1["finished"]
    assert [r["step"] for r in rank0["reports"]] == [1, 2, 4]
    for report0, report1 in zip(rank0["reports"], rank1["reports"], strict=True):
        assert report0["probes"][0] == ["descent", "*", None]
        assert report0["probes"] == report1["probes"]  # same kinds, tensors and indices on both ranks
        assert report0["verdict"] == report1["verdict"] != "fail"
        assert report0["notes"] == report1["notes"]
        assert report0["note_codes"][-1] == NoteCode.RANKS_SHARDS
        assert "rank 0:" in report0["notes"][-1]
        assert "rank 1:" in report0["notes"][-1]
    assert recomputed_counts(rank0["counts"]) == recomputed_counts(rank1["counts"])
    assert recomputed_counts(rank0["counts"]) == {"checks": 3, "failed": 0, "skipped": 0, "postponed": 0}


def test_only_rank_zero_writes_event_files(ddp: dict[str, Any]) -> None:
    rank0, rank1 = _ranks(ddp, "healthy")
    assert rank0["real_writer"] is True
    assert rank1["real_writer"] is False
    log_dir = ddp["out"] / "tb" / "healthy" / "version_0"
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("gradwatch/verdict")] == [1, 2, 4]


def test_zero_interference_and_bucket_view_grads_untouched(ddp: dict[str, Any]) -> None:
    # gradient_as_bucket_view=True: .grad are views into DDP's buckets; the check detaches and puts back the same
    # tensor objects, and the whole run ends bit-identical to the same run without gradwatch, on each rank
    for rank in (0, 1):
        assert ddp[f"healthy_rank{rank}"]["grads_untouched"] is True
        assert ddp[f"healthy_rank{rank}"]["digest"] == ddp[f"baseline_rank{rank}"]["digest"]


def test_a_failure_on_one_rank_stops_every_rank_at_the_same_step(ddp: dict[str, Any]) -> None:
    rank0, rank1 = _ranks(ddp, "bug_on_rank1")
    # without agreement rank 1 would stop and rank 0 would wait for it in the next gradient all-reduce forever
    assert rank0["global_step"] == rank1["global_step"] == 1
    assert rank0["should_stop"]
    assert rank1["should_stop"]
    assert rank0["finished"]
    assert rank1["finished"]
    assert rank0["reports"] == rank1["reports"]
    (report,) = rank0["reports"]
    assert report["verdict"] == "fail"
    assert report["note_codes"][-1] == NoteCode.RANKS_SHARDS
    assert "rank 0: ok, rank 1: fail" in report["notes"][-1]
    assert "rank 1's" in report["notes"][-1]
    assert recomputed_counts(rank0["counts"]) == recomputed_counts(rank1["counts"])
    assert recomputed_counts(rank0["counts"]) == {"checks": 1, "failed": 1, "skipped": 0, "postponed": 0}


def test_a_check_raising_on_one_rank_raises_on_every_rank(ddp: dict[str, Any]) -> None:
    rank0, rank1 = _ranks(ddp, "raise_on_rank1")
    assert rank1["error"] == "RuntimeError: training_step failed on purpose"
    # a RuntimeError (the scenario catches RuntimeError), of its own type so that it passes gradwatch's guards
    assert rank0["error"].startswith(
        "RaisedOnAnotherRankError: gradwatch: the gradient check at step 1 raised on rank 1"
    )
    assert rank0["global_step"] == rank1["global_step"] == 1


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_sync_batch_norm_on_two_gpus(tmp_path: Path) -> None:
    # SyncBatchNorm refuses CPU tensors and NCCL refuses two ranks on one GPU: this runs only with two GPUs
    results = _run(tmp_path, "--syncbn")
    rank0, rank1 = results["syncbn_rank0"], results["syncbn_rank1"]
    assert rank0["global_step"] == rank1["global_step"] == 4
    assert [r["step"] for r in rank0["reports"]] == [1, 2, 4]
    assert rank0["reports"] == rank1["reports"]
    assert all(r["verdict"] != "fail" for r in rank0["reports"])
    assert not rank0["forward_left_patched"]
    assert not rank1["forward_left_patched"]
