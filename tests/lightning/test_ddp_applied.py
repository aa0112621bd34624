"""Applied checks under real two-process DDP (CPU, gloo): the window loss is the ranks' mean, a communication hook that
scales a bucket is a reduction fault, a rank whose gradient differs after the reduction is named, and a healthy run
trains exactly as without gradwatch. The fits run in ``tests/ddp_applied_run.py`` (see ``test_ddp.py`` for why)."""

from __future__ import annotations

from typing import Any

import pytest
from two_processes import needs_gloo, run_ranks

pytestmark = [needs_gloo, pytest.mark.slow]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ranks("ddp_applied_run.py", tmp_path_factory.mktemp("ddp_applied"), timeout_s=120)[0]


def _both(ddp: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    return [ddp[f"{scenario}_rank{rank}"] for rank in (0, 1)]


def test_healthy_runs_pass_on_every_rank_and_train_as_without(ddp: dict[str, Any]) -> None:
    for rank in _both(ddp, "healthy"):
        assert [(a["step"], a["verdict"]) for a in rank["applied"]] == [(1, "ok"), (2, "ok"), (3, "ok")]
    for checked, plain in zip(_both(ddp, "healthy"), _both(ddp, "baseline"), strict=True):
        assert checked["digest"] == plain["digest"]  # parameters and buffers (each rank's own BatchNorm statistics)


def test_a_communication_hook_that_scales_a_bucket_is_a_reduction_fault(ddp: dict[str, Any]) -> None:
    for rank in _both(ddp, "comm_hook"):
        first = rank["applied"][0]
        assert (first["step"], first["verdict"], first["fault"]) == (1, "fail", "reduction")
        assert "plain all-reduce, is right" in first["message"]


def test_a_rank_whose_reduced_gradient_differs_is_named(ddp: dict[str, Any]) -> None:
    for rank in _both(ddp, "rank1_corrupted"):
        first = rank["applied"][0]
        assert (first["step"], first["verdict"], first["fault"]) == (1, "fail", "reduction")
        assert "rank(s) [1]" in first["message"]
        assert [a["verdict"] for a in rank["applied"][1:]] == ["ok", "ok"]
