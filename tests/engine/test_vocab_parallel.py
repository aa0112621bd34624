"""A language-model head split over its vocabulary (2-way tensor parallelism, gloo) with a hand-written vocab-parallel
cross-entropy (Megatron-LM's: the logits never gathered, the maximum, the sum of exponentials and the target's logit
all-reduced over the group). A backward that drops the other shard's term of the softmax's denominator is caught at
the first applied check on both ranks; the correct loss is clean and trains bit for bit as without gradwatch; the
recomputed check, which makes the parameters whole, refuses such a loss (``loss-for-shards``) instead of failing a
correct model. The loop runs in ``tests/vocab_parallel_run.py``, one process per rank."""

from __future__ import annotations

from typing import Any

import pytest
from two_processes import needs_gloo, run_launched

pytestmark = [needs_gloo, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("vocab_parallel")
    return run_launched("vocab_parallel_run.py", out, "healthy", "baseline", "local_softmax", timeout_s=240)[0]


def _ranks(runs: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    return [runs[f"{scenario}_rank{rank}"] for rank in range(2)]


def test_the_loss_is_the_full_vocabulary_cross_entropy(runs: dict[str, Any]) -> None:
    for rank in _ranks(runs, "healthy"):
        full, parallel = rank["losses"]
        assert abs(full - parallel) < 1e-5 * full


def test_a_correct_vocab_parallel_loss_is_clean_and_trains_as_without(runs: dict[str, Any]) -> None:
    for checked, plain in zip(_ranks(runs, "healthy"), _ranks(runs, "baseline"), strict=True):
        kinds = [(r["step"], r["scope"], r["verdict"]) for r in checked["reports"]]
        assert kinds == [(1, "applied", "ok"), (2, "applied", "ok"), (2, "recomputed", "inconclusive"),
                         (3, "applied", "ok")]  # fmt: skip
        recomputed = next(r for r in checked["reports"] if r["scope"] == "recomputed")
        assert recomputed["note_codes"] == ["loss-for-shards"]  # refused, not failed (it was `replicas-disagree`)
        assert (checked["params"], checked["optimizer"]) == (plain["params"], plain["optimizer"])


def test_a_backward_dropping_the_other_shards_term_is_caught_at_the_first_applied_check(runs: dict[str, Any]) -> None:
    for rank in _ranks(runs, "local_softmax"):
        first = rank["reports"][0]
        assert (first["step"], first["scope"], first["verdict"], first["fault"]) == (1, "applied", "fail", "formula")
        assert "head.weight" in first["failures"]
        assert all(r["verdict"] != "ok" for r in rank["reports"])
