"""Why a check was inconclusive, in words, and what to do about it.

A run whose checks keep ending inconclusive checks nothing; the callback warns once when that happens
(:class:`~gradwatch.watch.alerts.Remarks`), with the reason this module reads from the report: its notes (a loss
that cannot be reproduced, or is too close to zero to check) and the reasons of its inconclusive probes.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from gradwatch.engine.results.notes import NoteCode
from gradwatch.engine.results.report import CheckReport


class Diagnosis(NamedTuple):
    """Why a check could not decide, and the remedy."""

    reason: str
    remedy: str


_BY_NOTE = (
    (
        NoteCode.FAKE_QUANTISATION,
        Diagnosis(
            "the loss is piecewise constant: fake quantisation (straight-through estimators by design) sits in the "
            "model",
            "check with fake quantisation off during the check's steps (model.apply(torch.ao.quantization."
            "disable_fake_quant) before, enable_fake_quant after), or check the float model before preparing it for "
            "quantisation-aware training",
        ),
    ),
    (
        NoteCode.NOT_REPRODUCIBLE,
        Diagnosis(
            "the loss is not the same function at every evaluation: it draws randomness gradwatch cannot replay (a "
            "private torch.Generator)",
            "draw from torch's global generator, or pass GradWatch(loss_fn=...) a loss without that randomness",
        ),
    ),
    (
        NoteCode.LOSS_NEAR_ZERO,
        Diagnosis(
            "the loss is so close to zero that the rounding of its gradient alone may exceed any error",
            "check on data the model has not memorised, or train in float64",
        ),
    ),
)

_BY_REASON = {
    "flat": Diagnosis(
        "the loss did not change at the probes' steps: it is computed in a lower precision than the probes move the "
        "parameters (a cast to float32 inside the loss, or a saturated loss)",
        "GradWatch(precision='native') probes in the model's own dtype",
    ),
    "kink": Diagnosis(
        "the checked points sit on kinks of the loss (ReLU, max-pool, clamp, piecewise-constant ops)",
        "later checks land on other points; a model made mostly of such operations is checked more surely in float64 "
        "(precision='float64') or with more probes per check",
    ),
    "tie": Diagnosis(
        "the checked points sit on ties of the loss (max-pool or ReLU at equal values, grid_sample on the grid)",
        "later checks land on other points; data with exactly constant regions ties at every check",
    ),
    "unresolved": Diagnosis(
        "round-off hides what the probes measure",
        "GradWatch(precision='float64') probes in float64",
    ),
    "unstable": Diagnosis(
        "the probes' discrepancies did not reproduce from one step to the next (kinks near the point, or a loss that "
        "varies between evaluations)",
        "make the loss deterministic (no non-deterministic kernels during checks)",
    ),
    "surrogate": Diagnosis(
        "the loss is piecewise constant in tensors whose gradient is a straight-through estimator",
        "exempt them with ignore= (the report's surrogates give the pattern)",
    ),
    "nonfinite": Diagnosis("the loss is not finite near the checked points", "look for overflow in the loss"),
}


def diagnose(report: CheckReport) -> Diagnosis | None:
    """Why ``report`` is inconclusive and what to do; ``None`` for a conclusive report."""
    if report.verdict != "inconclusive":
        return None
    for code, diagnosis in _BY_NOTE:
        if report.noted(code):
            return diagnosis
    reasons = Counter(p.reason for p in report.probes if p.verdict == "inconclusive")
    for reason, _ in reasons.most_common():
        if reason in _BY_REASON:
            return _feasible(_BY_REASON[reason], report)
    first_note = report.notes[0] if report.notes else "no probe could be made"
    return Diagnosis(first_note, "see the report's notes")


def _feasible(diagnosis: Diagnosis, report: CheckReport) -> Diagnosis:
    """``diagnosis`` with a remedy that can work on the model: no float64 advice where float64 probes cannot be used
    (the loss does not run in float64, or float64 evaluates another function)."""
    refused = next((note for note in report.notes if getattr(note, "code", None) in _NO_FLOAT64), None)
    if refused is None or "float64" not in diagnosis.remedy:
        return diagnosis
    return Diagnosis(
        diagnosis.reason,
        f"float64 probes cannot be used on this model ({refused}); more probes per check (tensor_probes=, "
        "random_probes=) or checks at more points decide more often",
    )


_NO_FLOAT64 = (NoteCode.NATIVE_PRECISION, NoteCode.FLOAT64_UNFAITHFUL)
