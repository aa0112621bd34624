"""GradWatch under real two-process FSDP2 (Lightning's ``ModelParallelStrategy``, CPU, gloo): one check of the global
loss run together by both ranks, verdicts that agree, a planted bug named, a rank that raises leaving none hanging,
and training bit-identical with and without the checks.

The strategy relaunches the running script for rank 1, so the fits run in ``tests/fsdp_run.py`` in a subprocess with
a bounded timeout (a hang fails the test instead of blocking the suite); each rank writes what it saw to JSON.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import recomputed_counts
from two_processes import needs_gloo, run_ranks

from gradwatch.engine.results.notes import NoteCode

pytestmark = [needs_gloo, pytest.mark.slow]


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ranks("fsdp_run.py", tmp_path_factory.mktemp("fsdp"), timeout_s=180)[0]


def _ranks(fsdp: dict[str, Any], scenario: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return fsdp[f"{scenario}_rank0"], fsdp[f"{scenario}_rank1"]


def test_every_rank_checks_the_sharded_model_with_no_false_alarm(fsdp: dict[str, Any]) -> None:
    rank0, rank1 = _ranks(fsdp, "healthy")
    assert rank0["sharded"]
    assert rank1["sharded"]
    assert rank0["finished"]
    assert rank1["finished"]
    assert recomputed_counts(rank0["counts"]) == recomputed_counts(rank1["counts"])
    assert recomputed_counts(rank0["counts"]) == {"checks": 4, "failed": 0, "skipped": 0, "postponed": 0}
    for report in rank0["reports"]:
        assert report["verdict"] == "ok"
        assert all(probe[3] != "fail" for probe in report["probes"])
        assert report["note_codes"][0] == NoteCode.SHARDED
        assert "2 ranks" in report["notes"][0]
        assert report["note_codes"][-1] == NoteCode.RANKS_TOGETHER


def test_both_ranks_report_the_same_probes_and_verdicts(fsdp: dict[str, Any]) -> None:
    for scenario in ("healthy", "bug"):
        rank0, rank1 = _ranks(fsdp, scenario)
        probes0 = [(r["step"], r["verdict"], r["probes"]) for r in rank0["reports"]]
        probes1 = [(r["step"], r["verdict"], r["probes"]) for r in rank1["reports"]]
        assert probes0 == probes1


def test_coordinate_probes_address_global_indices(fsdp: dict[str, Any]) -> None:
    rows = {"inp.weight": 16, "inp.bias": 16, "custom.weight": 12, "gate.weight": 1, "gate.bias": 1, "out.weight": 3}
    rows.update({"out.bias": 3, "temperature": 3})
    coordinates = [p for r in fsdp["healthy_rank0"]["reports"] for p in r["probes"] if p[0] == "param"]
    assert len(coordinates) == 4
    assert all(index[0] < rows[target] for _, target, index, _ in coordinates)
    # rank 0 holds the first half of each tensor's rows: some probed coordinate lies in rank 1's half
    assert any(index[0] >= -(-rows[target] // 2) for _, target, index, _ in coordinates)


def test_a_wrong_weight_gradient_fails_every_check_and_names_the_weight(fsdp: dict[str, Any]) -> None:
    for rank in _ranks(fsdp, "bug"):
        assert rank["counts"]["failed"] == rank["counts"]["checks"] == 4
        for report in rank["reports"]:
            assert "custom.weight" in report["failures"]
            assert set(report["failures"]) <= {"*", "custom.weight"}


def test_a_rank_that_raises_inside_the_check_leaves_no_rank_waiting(fsdp: dict[str, Any]) -> None:
    rank0, rank1 = _ranks(fsdp, "raise_on_rank1")
    assert rank0["global_step"] == rank1["global_step"] == 3
    assert rank0["finished"]
    assert rank1["finished"]
    assert recomputed_counts(rank0["counts"]) == recomputed_counts(rank1["counts"])
    assert recomputed_counts(rank0["counts"]) == {"checks": 0, "failed": 0, "skipped": 3, "postponed": 0}


def test_training_is_bit_identical_with_and_without_gradwatch(fsdp: dict[str, Any]) -> None:
    for rank in (0, 1):
        healthy, baseline = fsdp[f"healthy_rank{rank}"], fsdp[f"baseline_rank{rank}"]
        assert healthy["params"] == baseline["params"]
        assert healthy["optimizer"] == baseline["optimizer"]
    assert fsdp["healthy_rank0"]["params"] != fsdp["healthy_rank1"]["params"]  # the digests are of different shards
