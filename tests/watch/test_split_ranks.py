"""Ranks that hold different parameters without a library that says how (issue 44): a model split across two ranks
by hand was taken for DDP, and its correct control failed with ``reduction`` ("rank(s) [1] hold a different
gradient"). The watch compares the ranks' parameters (names and shapes, one gather) before a check, and checks such a
model as what it is (:mod:`gradwatch.engine.applied.split`): one model of every rank's parameters against the sum of
the ranks' losses, every rank evaluating it together, both kinds of check (note ``ranks-split``). Three splits
(``tests/split_model_run.py``): separate parts with their own losses, tensor parallelism through
``torch.distributed.nn``'s all-reduce (the summed loss's gradient), and through Megatron's identity-backward reduce (the
gradient of the one loss every rank computes). Correct: every check ``ok``; rank 1's first weight gradient halved:
both kinds fail at the first check, naming rank 1's tensor and no other rank's. Training is bit-identical with and
without the watch."""

from __future__ import annotations

from typing import Any

import pytest
from two_processes import needs_gloo, run_launched

pytestmark = [pytest.mark.slow, needs_gloo]

KINDS = ("parts", "tensor_parallel", "megatron")
FIRST_WEIGHT = {"parts": "rank.1.0.weight", "tensor_parallel": "rank.1.up.weight", "megatron": "rank.1.up.weight"}


@pytest.fixture(scope="module")
def found(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    scenarios = [f"{kind}{suffix}" for kind in KINDS for suffix in ("", "_halved")]
    results, _ = run_launched("split_model_run.py", tmp_path_factory.mktemp("split"), *scenarios, timeout_s=900)
    return results


def _each_rank(found: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    results = [found[f"{scenario}_rank{rank}"] for rank in (0, 1)]
    for result in results:
        assert result["identical"], result  # the watch changed nothing training computes
        assert not [w for w in result["warnings"] if "no recomputed checks" in w], result["warnings"]
    return results


@pytest.mark.parametrize("kind", KINDS)
def test_a_correct_split_model_is_checked_and_passes(found: dict[str, Any], kind: str) -> None:
    for result in _each_rank(found, kind):
        checks = [r for r in result["reports"] if r["scope"] in ("applied", "recomputed")]
        assert {r["scope"] for r in checks} == {"applied", "recomputed"}, result
        assert len(checks) == 6, result  # both kinds at each of the three steps, none skipped
        for report in checks:
            assert report["verdict"] == "ok", report
            assert report["fault"] is None, report
            assert "ranks-split" in report["notes"], report


@pytest.mark.parametrize("kind", KINDS)
def test_a_halved_gradient_on_one_rank_is_caught_at_the_first_check_naming_it(found: dict[str, Any], kind: str) -> None:
    for result in _each_rank(found, f"{kind}_halved"):
        for scope in ("applied", "recomputed"):
            first = next(r for r in result["reports"] if r["scope"] == scope)
            assert first["step"] == 1, first
            assert first["verdict"] == "fail", first
            assert first["fault"] != "reduction", first
            named = [t for t in first["failing"] if t.startswith("rank.")]
            assert named == [FIRST_WEIGHT[kind]], first  # rank 1's tensor, no other rank's
