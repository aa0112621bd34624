"""Alert policy: rate-limited warnings, raise, stop, callables."""

from __future__ import annotations

import warnings

import pytest

from gradwatch import GradientCheckError, GradientCheckWarning
from gradwatch.engine.report import CheckReport, Probe
from gradwatch.lightning.alerts import AlertPolicy, Backoff, failure_message


def _report(verdict: str = "fail", failures: int = 1) -> CheckReport:
    probes = [
        Probe("param", "w", (i,), 1.0, 2.0, 1 / 3, "fail" if verdict == "fail" else "ok", 1e-6, 1e-3, "discrepancy")
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
    message = failure_message(_report(failures=9), limit=5)
    assert "... and 4 more" in message
    assert message.count("param w[") == 5


def test_check_errors_are_rate_limited_separately() -> None:
    policy = AlertPolicy("warn")
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for _ in range(5):
            policy.check_error(3, RuntimeError("oops"))
    assert [w.category for w in warned] == [GradientCheckWarning] * 3  # errors number 1, 2 and 4
    assert policy.failures.count == 0
