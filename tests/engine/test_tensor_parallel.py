"""Both kinds of check on a tensor-parallel model (``torch.distributed.tensor.parallel`` on ``DTensor``, CPU, gloo; a
Megatron-style sequence-parallel norm before a column- and a row-parallel ``Linear``), on two processes (a 1-D mesh)
and on four (a 2-D mesh ``("dp", "tp") = (2, 2)``, FSDP2 on ``"dp"`` over the plan on ``"tp"``): a healthy run is
checked with no false alarm and trains bit for bit as without gradwatch; the norm's gradient left unreduced by the
plan (on every rank, or on one) is caught at the first applied check by the cross-rank comparison of replicated
gradients (fault ``reduction``, ranks named) and by the recomputed check; a replicated gradient reduced twice is caught
at the first applied check (fault ``reduction``); a 3% formula bug in a replicated module fails both kinds of check and
names the module. FSDP2's hybrid sharding on a 2-D mesh (no tensor parallelism) takes the same path: checked clean,
and one rank's shard of a gradient scaled after the reduction caught (``reduction``). The loop runs in
``tests/tensor_parallel_run.py``, one process per rank."""

from __future__ import annotations

from typing import Any

import pytest
from two_processes import needs_gloo, run_launched

pytestmark = [needs_gloo, pytest.mark.slow]


@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("tensor_parallel")
    return run_launched(
        "tensor_parallel_run.py", out, "healthy", "baseline", "unreduced", "twice", "formula", timeout_s=120
    )[0]


@pytest.fixture(scope="module")
def tp_fsdp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("tensor_parallel_fsdp")
    scenarios = ("healthy", "baseline", "unreduced_rank1", "twice", "formula", "hsdp", "hsdp_baseline", "hsdp_scaled")
    return run_launched("tensor_parallel_run.py", out, *scenarios, timeout_s=180, world=4)[0]


def _ranks(tp: dict[str, Any], scenario: str, world: int = 2) -> list[dict[str, Any]]:
    return [tp[f"{scenario}_rank{rank}"] for rank in range(world)]


def test_a_healthy_tensor_parallel_run_is_checked_clean_and_trains_as_without(tp: dict[str, Any]) -> None:
    for checked, plain in zip(_ranks(tp, "healthy"), _ranks(tp, "baseline"), strict=True):
        assert checked["dtensors"] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
        kinds = [(r["step"], r["scope"], r["verdict"]) for r in checked["reports"]]
        assert kinds == [(1, "applied", "ok"), (2, "applied", "ok"), (2, "recomputed", "ok"), (3, "applied", "ok")]
        assert all("tensor-parallel" in r["note_codes"] for r in checked["reports"])
        assert (checked["params"], checked["optimizer"]) == (plain["params"], plain["optimizer"])
    rank0, rank1 = _ranks(tp, "healthy")
    assert rank0["params"] != rank1["params"]  # each rank holds its own shards


def test_a_norm_gradient_left_unreduced_is_caught_at_the_first_applied_check_naming_the_rank(
    tp: dict[str, Any],
) -> None:
    for rank in _ranks(tp, "unreduced"):
        first = rank["reports"][0]
        assert (first["step"], first["scope"], first["verdict"], first["fault"]) == (1, "applied", "fail", "reduction")
        assert first["message"].startswith("rank(s) [1] hold a different gradient than rank 0")
        recomputed = next(r for r in rank["reports"] if r["scope"] == "recomputed")
        assert recomputed["verdict"] == "fail"
        assert {"norm.weight", "norm.bias"} <= set(recomputed["failures"])


def test_a_replicated_gradient_reduced_twice_is_caught_at_the_first_applied_check(tp: dict[str, Any]) -> None:
    for rank in _ranks(tp, "twice"):
        first = rank["reports"][0]
        assert (first["step"], first["verdict"], first["fault"]) == (1, "fail", "reduction")
        assert first["failures"] == ["*", "norm.weight"]
        assert [r["verdict"] for r in rank["reports"][1:]] == ["ok"] * 3  # planted once


def test_a_healthy_tensor_parallel_run_with_fsdp2_on_a_second_mesh_dimension_is_checked_clean(
    tp_fsdp: dict[str, Any],
) -> None:
    for checked, plain in zip(_ranks(tp_fsdp, "healthy", 4), _ranks(tp_fsdp, "baseline", 4), strict=True):
        dtensors = ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "gate.weight", "norm.bias", "norm.weight"]
        assert checked["dtensors"] == dtensors
        kinds = [(r["step"], r["scope"], r["verdict"]) for r in checked["reports"]]
        assert kinds == [(1, "applied", "ok"), (2, "applied", "ok"), (2, "recomputed", "ok"), (3, "applied", "ok")]
        assert all("tensor-parallel" in r["note_codes"] for r in checked["reports"])
        assert (checked["params"], checked["optimizer"]) == (plain["params"], plain["optimizer"])
    assert len({rank["params"] for rank in _ranks(tp_fsdp, "healthy", 4)}) == 4  # each rank its own shards


def test_a_norm_gradient_left_unreduced_over_tp_on_one_rank_under_fsdp2_is_caught_naming_the_ranks(
    tp_fsdp: dict[str, Any],
) -> None:
    for rank in _ranks(tp_fsdp, "unreduced_rank1", 4):
        first = rank["reports"][0]
        assert (first["step"], first["scope"], first["verdict"], first["fault"]) == (1, "applied", "fail", "reduction")
        # rank 1 kept its own gradient; FSDP's reduce-scatter over its data-parallel group (ranks 1 and 3) carried it
        assert first["message"].startswith("rank(s) [1, 3] hold a different gradient than rank 0")
        recomputed = next(r for r in rank["reports"] if r["scope"] == "recomputed")
        assert recomputed["verdict"] == "fail"
        assert {"norm.weight", "norm.bias"} <= set(recomputed["failures"])


def test_a_replicated_gradient_reduced_twice_under_fsdp2_is_caught_at_the_first_applied_check(
    tp_fsdp: dict[str, Any],
) -> None:
    for rank in _ranks(tp_fsdp, "twice", 4):
        first = rank["reports"][0]
        assert (first["step"], first["verdict"], first["fault"]) == (1, "fail", "reduction")
        assert first["failures"] == ["*", "norm.weight"]
        assert [r["verdict"] for r in rank["reports"][1:]] == ["ok"] * 3  # planted once


@pytest.mark.parametrize("world", [2, 4], ids=["tp", "tp+fsdp2"])
def test_a_formula_bug_fails_both_kinds_of_check_and_names_the_module(
    tp: dict[str, Any], tp_fsdp: dict[str, Any], world: int
) -> None:
    for rank in _ranks(tp if world == 2 else tp_fsdp, "formula", world):
        assert [r["verdict"] for r in rank["reports"]] == ["fail"] * 4
        for report in rank["reports"]:
            assert "gate.weight" in report["failures"]
            assert report["culprits"][0] == "gate"
            assert report["fault"] == ("formula" if report["scope"] == "applied" else None)


def test_hybrid_sharding_on_a_2d_mesh_is_checked_clean_and_a_scaled_shard_caught(tp_fsdp: dict[str, Any]) -> None:
    for checked, plain in zip(_ranks(tp_fsdp, "hsdp", 4), _ranks(tp_fsdp, "hsdp_baseline", 4), strict=True):
        assert [(r["scope"], r["verdict"]) for r in checked["reports"]] == [("applied", "ok")] * 2 + [
            ("recomputed", "ok"),
            ("applied", "ok"),
        ]
        assert (checked["params"], checked["optimizer"]) == (plain["params"], plain["optimizer"])
    for rank in _ranks(tp_fsdp, "hsdp_scaled", 4):
        first = rank["reports"][0]
        assert (first["step"], first["verdict"], first["fault"]) == (1, "fail", "reduction")
        # rank 1's shard is gathered by ranks 0 and 1 (its shard group): ranks 2 and 3 differ from rank 0
        assert first["message"].startswith("rank(s) [2, 3] hold a different gradient than rank 0")
        assert [r["verdict"] for r in rank["reports"][1:]] == ["ok"] * 3
