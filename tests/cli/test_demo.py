"""The examples run as tests: the demo keeps quiet on the healthy model and catches the planted bug."""

from __future__ import annotations

import doctest
import sys
from pathlib import Path

import pytest

import gradwatch.cli.demo
import gradwatch.engine.recomputed.check
from gradwatch import CheckReport

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import demo  # noqa: E402


def test_demo_runs_and_reports_both_outcomes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--logdir", str(tmp_path), "--steps", "12", "--every", "6", "--no-progress-bar"]) == 0
    out = capsys.readouterr().out
    assert "healthy: no false alarm (3 checks, none failed)" in out
    assert "rmsnorm: caught at step 1 (the first check)" in out
    assert "net.0.weight" in out  # the layer feeding the broken custom Function
    assert f"tensorboard --logdir {tmp_path}" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["healthy", "rmsnorm"]


@pytest.mark.parametrize("bug", ["scale", "detach"])
def test_each_planted_bug_is_caught_at_the_first_check(bug: str, tmp_path: Path) -> None:
    reports, _ = gradwatch.cli.demo.train(gradwatch.cli.demo.RUNS[bug], tmp_path, steps=1, every=50, progress_bar=False)
    assert [r.verdict for r in reports] == ["fail"]


def test_outcome_says_when_a_run_did_not_end_as_it_should() -> None:
    def reports(*verdicts: str) -> list[CheckReport]:
        return [CheckReport(i + 1, v, [], 0.0, 1, 1, duration_s=0.0) for i, v in enumerate(verdicts)]  # type: ignore[arg-type]

    healthy, bug = gradwatch.cli.demo.RUNS["none"], gradwatch.cli.demo.RUNS["rmsnorm"]
    assert gradwatch.cli.demo.outcome(healthy, reports("ok", "fail")) == (
        False,
        "FALSE ALARM: 1 of 2 checks failed, first at step 2",
    )
    assert gradwatch.cli.demo.outcome(bug, reports("ok", "ok")) == (False, "NOT CAUGHT: none of 2 checks failed")
    assert gradwatch.cli.demo.outcome(bug, reports("ok", "fail"))[0]


def test_docstring_examples_run() -> None:
    results = doctest.testmod(gradwatch.engine.recomputed.check)
    assert results.attempted > 0
    assert results.failed == 0
