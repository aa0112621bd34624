"""Alert policy: rate-limited warnings, raise, stop, callables."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from gradwatch import GradientCheckError, GradientCheckWarning
from gradwatch.engine.results.rendering import render_text
from gradwatch.engine.results.report import CheckReport, Probe
from gradwatch.watch.alerts import AlertPolicy, Backoff


def _report(verdict: str = "fail", failures: int = 1) -> CheckReport:
    kept = "fail" if verdict == "fail" else "ok"
    probes = [
        Probe("param", "w", (i,), 1.0, 2.0, 1 / 3, verdict=kept, noise=1e-6, step=1e-3, reason="discrepancy")  # type: ignore[arg-type]
        for i in range(failures)
    ]
    return CheckReport(step=3, verdict=verdict, probes=probes, loss=1.0, n_forward=5, n_backward=1, duration_s=0.01)  # type: ignore[arg-type]


def test_backoff_admits_powers_of_two() -> None:
    backoff = Backoff()
    admitted = [n for n in range(1, 40) if backoff.admit()]
    assert admitted == [1, 2, 4, 8, 16, 32]
    assert backoff.next_reported == 64


def test_warn_names_the_failing_coordinate() -> None:
    with pytest.warns(GradientCheckWarning, match=r"failed at step 3 .*\n  param w\[0\]: analytic 1"):
        assert AlertPolicy("warn").handle(_report()) is False


def test_reports_that_did_not_fail_are_ignored() -> None:
    received = []
    for on_fail in ("warn", "raise", "stop", received.append):
        assert AlertPolicy(on_fail).handle(_report("ok")) is False
    assert received == []


def test_raise_stop_and_callable() -> None:
    report = _report()
    with pytest.raises(GradientCheckError) as raised:
        AlertPolicy("raise").handle(report)
    assert raised.value.report is report
    with pytest.warns(GradientCheckWarning, match="stopping training"):
        assert AlertPolicy("stop").handle(report) is True
    received = []
    assert AlertPolicy(received.append).handle(report) is False
    assert received == [report]


def test_long_failure_lists_are_truncated() -> None:
    message = render_text(_report(failures=9), limit=5)
    assert "... and 4 more" in message
    assert message.count("param w[") == 5


def test_the_warning_and_the_error_lead_with_the_culprit() -> None:
    culprit = "the backward of `blocks.0.norm` (`RMSNorm`) is wrong: its input gradient is 2.7% off"
    report = dataclasses.replace(_report(failures=2), culprits=["blocks.0.norm", "blocks.0"], culprit_message=culprit)
    lines = render_text(report).splitlines()
    assert lines[0] == f"gradwatch: gradient check failed at step 3: {culprit}"
    assert lines[1] == "  (2 of 2 probes failed)"
    with pytest.raises(GradientCheckError, match=r"failed at step 3: the backward of `blocks\.0\.norm`"):
        AlertPolicy("raise").handle(report)


def test_check_errors_are_rate_limited_separately() -> None:
    policy = AlertPolicy("warn")
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for _ in range(5):
            policy.check_error(3, RuntimeError("oops"))
    assert [w.category for w in warned] == [GradientCheckWarning] * 3  # errors number 1, 2 and 4
    assert policy.failures.count == 0


def _inconclusive(step: int) -> CheckReport:
    probe = Probe("tensor", "w", None, 1.0, 1.0, 0.0, verdict="inconclusive", noise=0.0, step=1e-3, reason="flat")
    return CheckReport(step=step, verdict="inconclusive", probes=[probe], loss=1.0, n_forward=1, n_backward=1,
                       duration_s=0.0)  # fmt: skip


def test_three_inconclusive_checks_in_a_row_warn_once_with_the_reason_and_the_remedy() -> None:
    from gradwatch.watch.alerts import Remarks

    remarks = Remarks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remarks.hear(_inconclusive(1))
        remarks.hear(_inconclusive(2))
        assert caught == []
        remarks.hear(_inconclusive(3))
        remarks.hear(_inconclusive(4))
    (warning,) = [w for w in caught if issubclass(w.category, GradientCheckWarning)]
    message = str(warning.message)
    assert "the last 3 checks (steps 1, 2, 3) were inconclusive" in message
    assert "lower precision" in message
    assert "precision='native'" in message


def test_a_conclusive_check_resets_the_count() -> None:
    from gradwatch.watch.alerts import Remarks

    remarks = Remarks()
    ok = CheckReport(step=3, verdict="ok", probes=[], loss=1.0, n_forward=1, n_backward=1, duration_s=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for report in (_inconclusive(1), _inconclusive(2), ok, _inconclusive(4), _inconclusive(5)):
            remarks.hear(report)
    assert caught == []


def test_an_accumulation_unlike_one_batch_warns_once_with_its_figures() -> None:
    from gradwatch.engine.results.notes import Note, NoteCode
    from gradwatch.watch.alerts import Remarks

    remarks = Remarks(verbose=False)
    note = Note(NoteCode.ACCUMULATION_UNEQUAL, "the accumulated gradient is 1.18x the gradient of the window's samples")
    fields = {"verdict": "ok", "probes": [], "loss": 1.0, "n_forward": 1, "n_backward": 1, "duration_s": 0.0}
    reports = [CheckReport(step=step, notes=[note], scope="applied", **fields) for step in (1, 2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for report in reports:
            remarks.hear(report)
    assert [str(w.message) for w in caught] == [f"gradwatch (step 1): {note}"]
    assert all(w.category is GradientCheckWarning for w in caught)
