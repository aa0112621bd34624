"""Ranks that hold different parameters without a library that says how (issue 44): a model split across two ranks by
hand (each rank its own layers, no DTensor) was taken for DDP, and its correct control failed with ``reduction``
("rank(s) [1] hold a different gradient"). The watch now compares the ranks' parameters (names and shapes, one
gather) before a check: such a model is refused with the reason (once for each kind of check), never failed. The
applied check refuses it (note ``ranks-split``), and the recomputed checks are skipped. Not checked, so rank 1's halved
gradient is not caught either: these checks have no way to evaluate such a model's loss across the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from two_processes import needs_gloo, run_launched

pytestmark = [pytest.mark.slow, needs_gloo]


@pytest.mark.parametrize("scenario", ["correct", "halved"])
def test_a_model_split_by_hand_is_refused_once_never_failed(tmp_path: Path, scenario: str) -> None:
    found, _ = run_launched("split_model_run.py", tmp_path, scenario, timeout_s=300)
    for rank in ("rank0", "rank1"):
        result = found[rank]
        assert result["reports"], result
        assert all(r["verdict"] != "fail" and r["fault"] != "reduction" for r in result["reports"]), result
        applied = [r for r in result["reports"] if r["scope"] == "applied"]
        assert applied, result
        assert all(r["verdict"] == "inconclusive" and "ranks-split" in r["notes"] for r in applied), result
        assert result["counts"]["skipped"] == 3  # the recomputed checks, refused
        refusals = [w for w in result["warnings"] if "split across the ranks by hand" in w]
        # said once for each kind: the recomputed checks' refusal, the applied checks' note
        assert sum("no recomputed checks in this run" in w for w in refusals) == 1, result["warnings"]
        assert len(refusals) == 2, result["warnings"]
