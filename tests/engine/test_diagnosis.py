"""Why a check was inconclusive, in words, with the remedy."""

from __future__ import annotations

import math

from gradwatch.engine.results.diagnosis import diagnose
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import CheckReport, Probe


def _report(verdict: str, reasons: list[str], notes: list[Note] | None = None) -> CheckReport:
    probes = [
        Probe("tensor", f"t{i}", None, 1.0, 1.0, 0.0, verdict="inconclusive", noise=0.0, step=1e-3, reason=r)
        for i, r in enumerate(reasons)
    ]
    return CheckReport(
        step=1, verdict=verdict, probes=probes, loss=1.0, n_forward=1, n_backward=1, duration_s=0.0, notes=notes or []
    )  # type: ignore[arg-type]


def test_a_conclusive_report_needs_no_diagnosis() -> None:
    assert diagnose(_report("ok", [])) is None
    assert diagnose(_report("fail", [])) is None


def test_flat_probes_point_to_a_lower_precision_inside_the_loss() -> None:
    diagnosis = diagnose(_report("inconclusive", ["flat", "flat", "kink"]))
    assert diagnosis is not None
    assert "lower precision" in diagnosis.reason
    assert "precision='native'" in diagnosis.remedy


def test_notes_come_first() -> None:
    report = _report("inconclusive", ["kink"], [Note(NoteCode.NOT_REPRODUCIBLE, "the loss is not reproducible")])
    diagnosis = diagnose(report)
    assert diagnosis is not None
    assert "randomness" in diagnosis.reason


def test_an_unknown_cause_repeats_the_first_note() -> None:
    diagnosis = diagnose(_report("inconclusive", [], [Note(NoteCode.NOT_PROBED, "something odd")]))
    assert diagnosis is not None
    assert diagnosis.reason == "something odd"
    assert not math.isnan(len(diagnosis.remedy))
