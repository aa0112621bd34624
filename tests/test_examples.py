"""The examples run as tests: the demo keeps quiet on the healthy model and catches the planted bug."""

from __future__ import annotations

import doctest
import sys
from pathlib import Path

import pytest

import gradwatch.check

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import demo  # noqa: E402


def test_demo_runs_and_reports_both_outcomes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--logdir", str(tmp_path), "--steps", "12", "--every", "6"]) == 0
    out = capsys.readouterr().out
    assert "healthy model: no false alarm" in out
    assert "custom Function with a wrong backward: caught at the first check" in out
    assert "net.0.weight" in out  # the layer feeding the broken custom Function
    assert f"tensorboard --logdir {tmp_path}" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["custom_function_bug", "healthy"]


def test_docstring_examples_run() -> None:
    results = doctest.testmod(gradwatch.check)
    assert results.attempted > 0
    assert results.failed == 0
