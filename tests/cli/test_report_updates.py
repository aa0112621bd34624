"""``gradwatch report`` lists the update checks of a run's ``gradwatch.jsonl`` (the update the optimizer made, against
a reference) and never hides their failure: a run whose only failure is an update check (a Muon that skips its
Newton-Schulz iteration, its gradients right) exits 1 with the fault; a healthy AdamW run lists its ok update checks
and exits 0."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from pathlib import Path

import torch
import update_models

from gradwatch import GradientWatch
from gradwatch.cli import main
from gradwatch.outputs.jsonl import JSONL_NAME
from gradwatch.outputs.sinks import JsonLinesSink


def _train(logdir: Path, make: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> GradientWatch:
    """2 steps of a tiny MLP, an applied and an update check at each, recorded in ``logdir``'s JSON lines record."""
    return update_models.watched_loop(make, 2, sinks=[JsonLinesSink(logdir / JSONL_NAME)], recomputed=True)


def _report(logdir: Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["report", str(logdir)])
    return code, out.getvalue()


def _update_rows(out: str) -> list[list[str]]:
    """The first three columns (step, verdict, fault) of the update checks' table."""
    section = out.split("update checks (the update the optimizer made):")[1].split("\n\n")[0]
    table = section.split("----")[-1].splitlines()[1:]
    return [line.split()[:3] for line in table]


def test_a_run_whose_only_failure_is_an_update_check_exits_1_and_lists_it(tmp_path: Path) -> None:
    watch = _train(tmp_path, lambda m: update_models.NoNewtonSchulzMuon([p for p in m.parameters() if p.ndim == 2]))
    assert [(r.verdict, r.fault) for r in watch.update_reports] == [("fail", "update")] * 2
    assert all(r.verdict == "ok" for r in watch.reports if r.scope != "update")  # the gradients were right
    code, out = _report(tmp_path)
    assert code == 1, out
    assert "update checks (the update the optimizer made): 2, 0 ok, 0 inconclusive, 2 fail" in out
    assert "update fault at step 1: the update of `" in out
    assert _update_rows(out) == [["1", "fail", "update"], ["2", "fail", "update"]], out
    assert "result: FAIL" in out


def test_a_healthy_run_lists_its_update_checks_and_exits_0(tmp_path: Path) -> None:
    watch = _train(tmp_path, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    assert [r.verdict for r in watch.update_reports] == ["ok"] * 2
    code, out = _report(tmp_path)
    assert code == 0, out
    assert "update checks (the update the optimizer made): 2, 2 ok, 0 inconclusive, 0 fail" in out
    assert _update_rows(out) == [["1", "ok", "-"], ["2", "ok", "-"]], out
