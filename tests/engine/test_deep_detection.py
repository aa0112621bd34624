"""A 2% backward bug in one deep tensor of a 12-layer transformer, whose share of ‖g‖² is tiny, fails the first check
(cover probes, not the tensors' turn) and is blamed on its module or a container of it, never another module."""

from __future__ import annotations

import pytest
from deep_models import deep_llama, language_model_loss, token_batches
from watched_runs import first_check_with


def _first_failing_check(bug_at: str | None, wrong_input: bool = False, checks: int = 1):  # type: ignore[no-untyped-def]
    model = deep_llama(bug_at, wrong_input=wrong_input)
    # every batch trained, as many checks as they hold (the first at step 1, then every 2 steps)
    made, report, _ = first_check_with(
        model, token_batches(2 * checks), language_model_loss, lr=1e-3, checks=2 * checks
    )
    return made, report


@pytest.mark.parametrize("wrong_input", [False, True], ids=["weight-gradient", "input-gradient"])
def test_a_two_percent_bug_in_a_deep_mlp_projection_fails_the_first_check(wrong_input: bool) -> None:
    first, report = _first_failing_check("layers.8.mlp.down_proj", wrong_input)
    assert first == 1
    assert report is not None
    named = report.culprits[0]
    assert named in ("layers.8.mlp.down_proj", "layers.8.mlp", "layers.8", ""), report.culprit_message


def test_the_correct_deep_model_passes() -> None:
    first, _ = _first_failing_check(None, checks=3)
    assert first is None
