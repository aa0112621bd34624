"""The two-process launcher the distributed tests share (``tests/two_processes.py``): a run whose rank gloo's C++
runtime aborted is made once more; a rank that fails ends the run within the grace period, not the timeout, and the
failure names each rank's exit code."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from two_processes import run_launched

pytestmark = pytest.mark.slow


def test_a_rank_aborted_by_the_runtime_is_launched_once_more(tmp_path: Path) -> None:
    results, _ = run_launched("launcher_run.py", tmp_path, "abort-once", timeout_s=60)
    assert (tmp_path / "aborted").exists()
    assert sorted(results) == ["abort-once_rank0", "abort-once_rank1"]


def test_a_failing_rank_ends_the_run_in_its_grace_period_and_is_named(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"ended early \(attempt 1\): exit codes by rank \[-9, 1\]"):
        run_launched("launcher_run.py", tmp_path, "exit-1", timeout_s=300)
    assert time.monotonic() - started < 60
