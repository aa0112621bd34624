"""One place turns a check's report into what every output backend shows: :func:`records_of`.

A backend (a sink, :mod:`.sinks`) picks from the :class:`CheckRecords` what it can show: every logger takes the
scalars, TensorBoard the histogram and the text too, Weights & Biases and MLflow the text, the JSON lines record all of
it. The numbers are computed once here, so two backends never disagree about a check.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass, field

from gradwatch.engine.results.notes import NoteCode
from gradwatch.engine.results.rendering import headline, log10_rel_error, rel_error_log10, render_markdown
from gradwatch.engine.results.report import FAULTS, VERDICTS, CheckReport
from gradwatch.tensorboard.writer import (
    APPLIED_FAILURE_TAG,
    APPLIED_PREFIX,
    CLIPPING_PREFIX,
    FAILURES_TAG,
    HISTOGRAM_TAG,
    UPDATE_FAILURE_TAG,
    UPDATE_PREFIX,
)

OVERHEAD_TAG = "gradwatch/overhead"
"""gradwatch's time so far as a fraction of the training time, the first checks included (a series of checks knows
it, a single check not): what ``max_overhead`` bounds, 700 at step 1 where a first check costs 700 steps' time."""

OVERHEAD_PERCENT_TAG = "gradwatch/overhead_percent"
"""gradwatch's share of the training time in percent, apart from the first checks (the first recomputed and the first
applied check, made whatever the budget): what the default budget keeps at 1 or below."""

FIRST_CHECKS_SECONDS_TAG = "gradwatch/first_checks_seconds"
"""The one-time cost of the first checks, in seconds (known from the first check on)."""

FIRST_CHECKS_STEPS_TAG = "gradwatch/first_checks_steps"
"""The one-time cost of the first checks in mean training steps (logged once a training step's time is known: from the
second check on)."""


@dataclass(frozen=True)
class Overhead:
    """gradwatch's time against the training time at a check of a series: all of it so far over the training time
    (``fraction``, :data:`OVERHEAD_TAG`), the same apart from the first checks (``steady_fraction``,
    :data:`OVERHEAD_PERCENT_TAG` in percent), the first checks' time (``first_seconds``,
    :data:`FIRST_CHECKS_SECONDS_TAG`) and the mean training step's (``step_seconds``, ``nan`` while unknown)."""

    fraction: float
    steady_fraction: float = 0.0
    first_seconds: float = math.nan
    step_seconds: float = math.nan

    def scalars(self) -> dict[str, float]:
        """The overhead scalars, by tag (those not known yet are ``nan``, left out by :func:`scalars_of`)."""
        steps = self.first_seconds / self.step_seconds if self.step_seconds > 0 else math.nan
        return {
            OVERHEAD_TAG: self.fraction,
            OVERHEAD_PERCENT_TAG: 100.0 * self.steady_fraction,
            FIRST_CHECKS_SECONDS_TAG: self.first_seconds,
            FIRST_CHECKS_STEPS_TAG: steps,
        }


LOG10_SUFFIX = "_log10"
LOG10_OF = ("gradwatch/rel_error_max", "gradwatch/rel_error_median", "gradwatch/rel_error_min")
"""The relative errors also logged as log10 (tag plus :data:`LOG10_SUFFIX`, floored at -12): a healthy run's 1e-7
and a failing one's 1e-2 are 5 apart on a chart, where on a linear one the healthy run is a flat line at 0."""


@dataclass(frozen=True)
class CheckRecords:
    """What the outputs show of one check.

    Attributes:
        step: The step the check ran at.
        scalars: The ``gradwatch/*`` scalars (:func:`scalars_of`), finite ones only: a backend never receives a NaN (a
            check without a descent probe has no descent ratio).
        text: The failing report in markdown, culprit first (:func:`render_markdown`); ``None`` when no probe failed.
        histograms: By tag, values to show as a histogram (``gradwatch/rel_error_log10``: every conclusive probe's).
        report: The report itself, for a backend that records more (the JSON lines record).
        text_tag: The tag a backend shows the text under (:data:`~gradwatch.tensorboard.writer.FAILURES_TAG`,
            :data:`APPLIED_FAILURE_TAG`, ...).
        labels: Short strings by tag, for the backends that take text: :data:`FAULT_NAME_TAG`, the fault of a failing
            applied check in words (``"precision"``), beside its numeric code ``gradwatch/applied/fault``.
    """

    step: int
    scalars: dict[str, float]
    text: str | None
    histograms: dict[str, list[float]]
    report: CheckReport
    text_tag: str = FAILURES_TAG
    _: KW_ONLY
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        """Whether the check failed (a backend flushes at once then, so a crash does not lose the evidence)."""
        return self.report.verdict == "fail"


def scalars_of(report: CheckReport, overhead: Overhead | float | None = None) -> dict[str, float]:
    """The finite ``gradwatch/*`` scalars of a report, with their log10 forms and the overhead's (``overhead``: an
    :class:`Overhead`, or a bare fraction for ``gradwatch/overhead`` alone)."""
    scalars = dict(report.scalars())
    if isinstance(overhead, Overhead):
        scalars.update(overhead.scalars())
    elif overhead is not None:
        scalars[OVERHEAD_TAG] = float(overhead)
    for tag in LOG10_OF:
        if tag in scalars:
            scalars[tag + LOG10_SUFFIX] = log10_rel_error(scalars[tag])
    return {tag: float(value) for tag, value in scalars.items() if math.isfinite(value)}


def records_of(report: CheckReport, overhead: Overhead | float | None = None) -> CheckRecords:
    """Everything the outputs show of a recomputed check (``overhead`` as for :func:`scalars_of`)."""
    values = rel_error_log10(report)
    return CheckRecords(
        step=report.step,
        scalars=scalars_of(report, overhead),
        text=render_markdown(report) or None,
        histograms={HISTOGRAM_TAG: values} if values else {},
        report=report,
    )


FAULT_NAME_TAG = APPLIED_PREFIX + "fault_name"
"""The fault of a failing applied check in words (``"precision"``, ``"accumulation"``: see
:data:`~gradwatch.engine.results.report.FAULTS`), for the backends that take text (under
:data:`~gradwatch.tensorboard.writer.CLIPPING_PREFIX` for the clip coefficient's check)."""


def applied_scalars(report: CheckReport) -> dict[str, float]:
    """The numbers logged for an applied check, under ``gradwatch/applied/`` (the clip coefficient's check under
    :data:`~gradwatch.tensorboard.writer.CLIPPING_PREFIX`): the verdict (0 ok, 1 inconclusive, 2 fail), the fault (0
    none, else its position in :data:`~gradwatch.engine.results.report.FAULTS` plus one), the descent ratio, the noise
    floor along it relative to ``‖g‖``, the largest discrepancy over its tolerance, the check's seconds and loss
    evaluations."""
    prefix = _applied_prefix(report)
    values = {
        **_verdict_and_fault(report),
        "descent_ratio": report.descent_ratio,
        "noise_floor": report.noise_floor,
        "floor_excess": report.floor_excess,
        "check_seconds": report.duration_s,
        "loss_evaluations": float(report.n_forward),
    }
    return {prefix + name: float(value) for name, value in values.items() if not math.isnan(value)}


def applied_text(report: CheckReport) -> str | None:
    """A failing applied check in markdown: its headline first, led by the fault and what named it (``precision
    fault: applied gradient check failed at step 4: ...``), then the whole report; ``None`` unless it failed."""
    if report.verdict != "fail":
        return None
    return f"{headline(report)}\n\n```\n{report}\n```"


def applied_records_of(report: CheckReport) -> CheckRecords:
    """Everything the outputs show of an applied check (``report.scope == "applied"``): its ``gradwatch/applied/*``
    scalars and, when it failed, its text under :data:`APPLIED_FAILURE_TAG` and its fault's name under
    :data:`FAULT_NAME_TAG`; no histogram."""
    return CheckRecords(
        step=report.step,
        scalars=applied_scalars(report),
        text=applied_text(report),
        histograms={},
        report=report,
        text_tag=APPLIED_FAILURE_TAG,
        labels={_applied_prefix(report) + "fault_name": str(report.fault)} if report.fault is not None else {},
    )


def _applied_prefix(report: CheckReport) -> str:
    return CLIPPING_PREFIX if report.noted(NoteCode.APPLIED_CLIPPING) else APPLIED_PREFIX


def _verdict_and_fault(report: CheckReport) -> dict[str, float]:
    fault = float(FAULTS.index(report.fault) + 1) if report.fault is not None else 0.0
    return {"verdict": float(VERDICTS.index(report.verdict)), "fault": fault}


def update_scalars(report: CheckReport) -> dict[str, float]:
    """The numbers logged for an update check, under ``gradwatch/update/``: the verdict and fault (as for an applied
    check), the largest relative error of an update against its reference, the largest floor (relative to the
    reference's norm), the largest discrepancy over its tolerance and the check's seconds."""
    errors = report.conclusive_rel_errors
    values = {
        **_verdict_and_fault(report),
        "rel_error_max": max(errors) if errors else math.nan,
        "noise_floor": report.noise_floor,
        "floor_excess": report.floor_excess,
        "check_seconds": report.duration_s,
    }
    return {UPDATE_PREFIX + name: float(value) for name, value in values.items() if math.isfinite(value)}


def report_records(report: CheckReport, overhead: Overhead | float | None = None) -> CheckRecords:
    """The records of a report of any kind: :func:`applied_records_of` for an applied check; for an update check its
    ``gradwatch/update/*`` scalars and, when it failed, its text under :data:`UPDATE_FAILURE_TAG`; else
    :func:`records_of` (with ``overhead``)."""
    if report.scope == "update":
        text = applied_text(report)
        return CheckRecords(report.step, update_scalars(report), text, {}, report, text_tag=UPDATE_FAILURE_TAG)
    return applied_records_of(report) if report.scope == "applied" else records_of(report, overhead)
