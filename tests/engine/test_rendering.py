"""The one renderer of a failing report: plain text and markdown, culprit first, limits, surrogates and notes."""

from __future__ import annotations

import dataclasses
import math

import pytest

from gradwatch.engine.results.rendering import (
    CULPRIT_PREFIX,
    LOG10_FLOOR,
    headline,
    log10_rel_error,
    ordered_failures,
    probe_table,
    render_markdown,
    render_text,
)
from gradwatch.engine.results.report import CheckReport, GradientCheckError, Probe

CULPRIT = "the backward of `blocks.0.norm` (`RMSNorm`) is wrong: its input gradient is 2.7% off"


def _probe(kind: str, target: str, verdict: str = "fail", index: tuple[int, ...] | None = None) -> Probe:
    return Probe(kind, target, index, 1.0, 1.05, 0.05, verdict=verdict, noise=1e-6, step=1e-3, reason="discrepancy")  # type: ignore[arg-type]


def _report(failures: int = 2, search: int = 0, **changes: object) -> CheckReport:
    probes = [_probe("descent", "*", "ok")]
    probes += [_probe("param", "w", index=(i,)) for i in range(failures)]
    probes += [_probe("activation", f"blocks.{i}") for i in range(search)]
    report = CheckReport(step=3, verdict="fail", probes=probes, loss=1.0, n_forward=5, n_backward=1, duration_s=0.01)
    return dataclasses.replace(report, **changes)  # type: ignore[arg-type]


def test_the_headline_names_the_culprit_else_the_counts() -> None:
    assert headline(_report(), "gradwatch: ") == (
        "gradwatch: gradient check failed at step 3 (2 of 3 probes failed; descent ratio 1.05, 1 for a correct "
        "gradient)"
    )
    with_culprit = _report(culprit_message=CULPRIT, culprits=["blocks.0.norm"])
    assert headline(with_culprit) == f"gradient check failed at step 3: {CULPRIT}"
    assert render_text(with_culprit).splitlines()[1].startswith("  (2 of 3 probes failed")


def test_the_culprit_search_probes_come_after_the_probes_that_found_the_bug() -> None:
    report = _report(failures=2, search=2)
    report = dataclasses.replace(report, probes=[report.probes[0], *report.probes[3:], *report.probes[1:3]])
    assert [p.kind for p in ordered_failures(report)] == ["param", "param", "activation", "activation"]
    lines = render_text(report, limit=1).splitlines()
    assert lines[1].startswith("  param w[0]")
    assert lines[2:] == ["  ... and 1 more", "  (and 2 failing probes of the culprit search)"]
    assert "| activation | `blocks.1` |" in render_markdown(report).splitlines()[-1]


@pytest.mark.parametrize(("limit", "shown", "more"), [(None, 9, None), (5, 5, 4), (0, 0, 9)], ids=["all", "5", "0"])
def test_limit_and_the_count_of_the_rest(limit: int | None, shown: int, more: int | None) -> None:
    text = render_text(_report(failures=9), limit=limit)
    assert text.count("param w[") == shown
    assert (f"... and {more} more" in text) is (more is not None)


def test_surrogates_and_notes_follow_the_probes_in_every_form() -> None:
    report = _report(surrogates=("a straight-through estimator in q.weight",), notes=["input probes skipped"])
    text = render_text(report).splitlines()
    assert text[-2:] == ["  surrogate: a straight-through estimator in q.weight", "  note: input probes skipped"]
    markdown = render_markdown(report).splitlines()
    assert markdown[-2:] == ["* a straight-through estimator in q.weight", "* note: input probes skipped"]


def test_markdown_leads_with_the_culprit_line_and_lists_every_failure() -> None:
    report = _report(failures=30, culprit_message=CULPRIT)
    lines = render_markdown(report).splitlines()
    assert lines[0] == "gradient check **failed** at step 3: 30 of 31 probes"
    assert lines[2] == f"{CULPRIT_PREFIX}{CULPRIT}"
    assert sum(line.startswith("| param | `w` |") for line in lines) == 30
    assert render_markdown(_report(failures=0)) == ""


def test_the_error_the_warning_and_the_helper_say_the_same() -> None:
    report = _report(culprit_message=CULPRIT, culprits=["blocks.0.norm"])
    error = str(GradientCheckError(report))
    assert error == render_text(report, limit=20, prefix="")
    assert render_text(report).startswith("gradwatch: " + error.splitlines()[0])
    table = render_text(report, prefix="", table=True).splitlines()
    assert table[2].split() == ["kind", "tensor[index]", "analytic", "numeric", "rel.", "error", "noise", "reason"]


def test_non_finite_numbers_are_written_as_words() -> None:
    probe = Probe("param", "w", (0,), math.nan, math.inf, math.nan, verdict="fail", noise=math.inf, step=1e-3,
                  reason="nonfinite")  # type: ignore[arg-type]  # fmt: skip
    report = _report(failures=0)
    report = dataclasses.replace(report, probes=[probe])
    assert "| nan | inf | nan | inf | nonfinite |" in render_markdown(report)
    assert probe_table([probe]).splitlines()[-1].split() == ["param", "w[0]", "nan", "inf", "nan", "inf", "nonfinite"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1e-7, -7.0), (0.0, LOG10_FLOOR), (1e-30, LOG10_FLOOR), (10.0, 1.0), (math.inf, math.inf)],
    ids=["1e-7", "zero", "tiny", "ten", "inf"],
)
def test_log10_is_floored(value: float, expected: float) -> None:
    assert log10_rel_error(value) == pytest.approx(expected)
    assert math.isnan(log10_rel_error(math.nan))
