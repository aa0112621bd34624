"""The agreement of processes through torch.distributed alone, in a real two-process gloo group: rank 0's budget
decision for all, the most severe report for all with every rank's verdict noted, a raise on one rank raised on all,
and the identity without a process group."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from gradwatch.engine.results.notes import NoteCode
from gradwatch.engine.results.report import CheckReport
from gradwatch.watch.distributed import agree_across_ranks, rank0_decides, world_size


def _report(verdict: str) -> CheckReport:
    return CheckReport(step=3, verdict=verdict, probes=[], loss=1.0, n_forward=1, n_backward=1, duration_s=0.0)  # type: ignore[arg-type]


def _run(rank: int, store: str, results: Any) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        decided = rank0_decides(5 if rank == 0 else 0)
        agreed = agree_across_ranks(_report("ok" if rank == 0 else "fail"), None, 3)
        assert agreed is not None
        raised = ""
        try:
            agree_across_ranks(_report("ok") if rank == 0 else None, None if rank == 0 else ValueError("boom"), 3)
        except RuntimeError as error:
            raised = str(error)
        results.put((rank, decided, agreed.verdict, [n.code for n in agreed.notes], str(agreed.notes[-1]), raised))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_processes_agree(tmp_path: Path) -> None:
    context = mp.get_context("spawn")
    results = context.Queue()
    mp.start_processes(_run, args=(str(tmp_path / "store"), results), nprocs=2, start_method="spawn")
    outcomes = sorted(results.get(timeout=60) for _ in range(2))
    for rank, decided, verdict, codes, note, _ in outcomes:
        assert decided == 5, rank  # rank 0's proposal
        assert verdict == "fail", rank  # rank 1's failure, on both
        assert codes[-1] == NoteCode.RANKS_SHARDS
        assert "rank 0: ok, rank 1: fail" in note
        assert "this report is rank 1's" in note
    assert outcomes[0][5].startswith("gradwatch: the gradient check at step 3 raised on rank 1 (ValueError: boom)")
    assert outcomes[1][5] == ""  # the rank that raised re-raises its own error (the watch does)


def test_without_a_process_group_both_are_the_identity() -> None:
    report = _report("ok")
    assert world_size() == 1
    assert rank0_decides(7) == 7
    assert agree_across_ranks(report, None, 3) is report
    assert dataclasses.asdict(report) == dataclasses.asdict(_report("ok"))
