"""Applied checks under real two-process FSDP2 (Lightning's ``ModelParallelStrategy``, CPU, gloo): every rank checks its
rows of the gradient FSDP reduce-scattered, together; healthy runs pass and train bit for bit as without gradwatch
(32-true; bf16-mixed with accumulation and clipping), and each planted fault is caught at the first applied check and
named: autocast-only backward → precision, wrong backward formula → formula, one rank's rows changed after the
reduce-scatter → reduction naming the rank, every rank's rows changed once → transient; and the engine's API in a plain
FSDP2 loop. The fits run in ``tests/fsdp_applied_run.py`` (see ``test_fsdp.py`` for why)."""

from __future__ import annotations

from typing import Any

import pytest
from two_processes import needs_gloo, run_ranks

pytestmark = [needs_gloo, pytest.mark.slow]


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    results, output = run_ranks("fsdp_applied_run.py", tmp_path_factory.mktemp("fsdp_applied"), timeout_s=240)
    return {**results, "output": output}


def _both(fsdp: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    return [fsdp[f"{scenario}_rank{rank}"] for rank in (0, 1)]


@pytest.mark.parametrize("scenario", ["healthy", "healthy_bf16"])
def test_healthy_runs_pass_on_every_rank_and_train_as_without(fsdp: dict[str, Any], scenario: str) -> None:
    baseline = scenario.replace("healthy", "baseline")
    for checked, plain in zip(_both(fsdp, scenario), _both(fsdp, baseline), strict=True):
        assert [(a["step"], a["verdict"]) for a in checked["applied"]] == [(1, "ok"), (2, "ok"), (3, "ok")]
        assert all(verdict == "ok" for _, verdict in checked["clipping"])  # the clip norm over every rank's shards
        assert all("sharded" in a["note_codes"] for a in checked["applied"])
        assert all(0 < a["floor_excess"] < 1 for a in checked["applied"])
        assert (checked["params"], checked["optimizer"]) == (plain["params"], plain["optimizer"])
    rank0, rank1 = _both(fsdp, scenario)
    assert rank0["params"] != rank1["params"]  # each rank holds its own shards: the check moved them alike
    assert [a["floor_excess"] for a in rank0["applied"]] == [a["floor_excess"] for a in rank1["applied"]]


def test_the_bf16_floor_is_the_paths_not_float32s(fsdp: dict[str, Any]) -> None:
    floors32 = [a["noise_floor"] for a in fsdp["healthy_rank0"]["applied"]]
    floors16 = [a["noise_floor"] for a in fsdp["healthy_bf16_rank0"]["applied"]]
    assert max(floors32) < 1e-5 < min(floors16)


@pytest.mark.parametrize(
    ("scenario", "fault", "failing"),
    [
        ("precision", "precision", "inp.weight"),
        ("formula", "formula", "custom.weight"),
        ("rank1_corrupted", "reduction", "inp.weight"),
        ("both_corrupted", "transient", "inp.weight"),
    ],
)
def test_a_planted_fault_is_caught_at_the_first_applied_check_and_named(
    fsdp: dict[str, Any], scenario: str, fault: str, failing: str
) -> None:
    for rank in _both(fsdp, scenario):
        first = rank["applied"][0]
        assert (first["step"], first["verdict"], first["fault"]) == (1, "fail", fault)
        assert failing in first["failures"]
        assert [a["verdict"] for a in rank["applied"][1:]] == ["ok"] * (len(rank["applied"]) - 1)
    if scenario == "rank1_corrupted":
        assert "rank(s) [1]" in fsdp["rank1_corrupted_rank0"]["applied"][0]["message"]


def test_a_failure_is_warned_once_not_once_per_rank(fsdp: dict[str, Any]) -> None:
    assert fsdp["output"].count("precision fault: applied gradient check failed at step 1") == 1


def test_a_check_that_raises_on_one_rank_ends_on_both_and_training_goes_on_as_without(fsdp: dict[str, Any]) -> None:
    for checked, plain in zip(_both(fsdp, "raise_on_rank1"), _both(fsdp, "baseline_2_steps"), strict=True):
        assert checked["global_step"] == 2
        assert [(a["step"], a["verdict"]) for a in checked["applied"]] == [(2, "ok")]  # step 1's check was skipped
        assert (checked["params"], checked["optimizer"]) == (plain["params"], plain["optimizer"])
    assert "could not run and was skipped (PeerFailureError" in fsdp["output"]


def test_a_plain_fsdp2_loop_checks_the_applied_gradient_with_the_engine_api(fsdp: dict[str, Any]) -> None:
    for rank in _both(fsdp, "plain"):
        assert [(a["step"], a["verdict"]) for a in rank["applied"]] == [(1, "ok"), (2, "fail")]
        second = rank["applied"][1]
        assert second["fault"] == "reduction"
        assert "rank(s) [1]" in second["message"]
        assert "out.weight" in second["failures"]
