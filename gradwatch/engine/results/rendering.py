"""A failing report in words, in one place: the warning, the exception, the assertion of the test helper, the demo,
the TensorBoard text, the JSON lines record and the loggers with text support all render it here, as plain text
(:func:`render_text`) or markdown (:func:`render_markdown`, which ``gradwatch report`` reads back).

Every form puts the culprit first (the module whose backward is wrong, when the check found it), then the failing
probes (those that found the discrepancy before the ones of the culprit search), "... and N more" past a limit, the
surrogate gradients the check recognised and its notes. The numbers shown on a log scale (:func:`log10_rel_error`)
live here too, so every backend floors them alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gradwatch.engine.results.kinds import ProbeKind, kinds_where

if TYPE_CHECKING:  # the report imports this module (GradientCheckError renders itself)
    from gradwatch.engine.results.report import CheckReport, Probe

CULPRIT_PREFIX = "culprit: "
"""The line of the markdown form that names the module whose backward is wrong (read back by ``gradwatch report``)."""

SEARCH_KINDS = kinds_where(culprit_search=True)
"""The probe kinds of a culprit search (as the kinds table says when this module is imported; the functions below ask
the table at each call)."""

DEFAULT_LIMIT = 5
"""Failing probes listed in the plain-text form before "... and N more"."""

LOG10_FLOOR = -12.0
"""Relative errors below 1e-12 (exact agreement included) are shown at -12."""

MARKDOWN_COLUMNS = ("kind", "tensor", "index", "analytic", "numeric", "rel. error", "noise", "reason")
"""The columns of the markdown table, found again by their header when it is read back."""

_TABLE_HEADER = ("kind", "tensor[index]", "analytic", "numeric", "rel. error", "noise", "reason")


def log10_rel_error(value: float) -> float:
    """``log10(value)`` floored at :data:`LOG10_FLOOR` (0 and below included); NaN stays NaN, inf stays inf."""
    if math.isnan(value) or value == math.inf:
        return value
    return max(math.log10(value), LOG10_FLOOR) if value > 0 else LOG10_FLOOR


def rel_error_log10(report: CheckReport) -> list[float]:
    """log10 of the finite relative errors of the report's conclusive probes, floored at :data:`LOG10_FLOOR`."""
    return [log10_rel_error(error) for error in report.conclusive_rel_errors if math.isfinite(error)]


def searches(kind: str) -> bool:
    """Whether probes of ``kind`` (a :class:`ProbeKind` or its word, as read back from a log) belong to a culprit
    search: they locate the module the other failing probes point to, and their target is a module, not a tensor."""
    try:
        return ProbeKind(kind).traits.culprit_search
    except ValueError:  # a kind this version does not know
        return False


def ordered_failures(report: CheckReport) -> list[Probe]:
    """The failing probes, those that found the discrepancy first and the culprit search's after them."""
    failures = report.failures
    return [p for p in failures if not p.kind.traits.culprit_search] + [
        p for p in failures if p.kind.traits.culprit_search
    ]


def nonfinite_loss(report: CheckReport) -> bool:
    """Whether the check failed because the loss itself is not finite at the checked point: no gradient there can be
    checked (or trusted), and no backward is shown wrong by it."""
    return any(p.kind == ProbeKind.LOSS and p.reason == "nonfinite" for p in report.failures)


def nonfinite_loss_words(report: CheckReport) -> str:
    """A non-finite loss in words: what it is, and that it is no wrong gradient."""
    value = next((p.analytic for p in report.failures if p.kind == ProbeKind.LOSS), report.loss)
    return (
        f"the loss is not finite ({value}) at step {report.step}: no gradient can be checked at this point, and this "
        "is not a wrong gradient (look for an overflow, a log or division of zero in the loss, or parameters already "
        "not finite)"
    )


def headline(report: CheckReport, prefix: str = "") -> str:
    """The first line: the step and the culprit, or the step and the count of failing probes when none was found; for
    an applied check, led by the fault and what named it; for a loss that is not finite, that (no gradient failure)."""
    if nonfinite_loss(report):
        return f"{prefix}{nonfinite_loss_words(report)}"
    if report.fault is not None:
        what = "update check" if report.scope == "update" else "applied gradient check"
        lead = f"{prefix}{report.fault} fault: {what} failed at step {report.step}"
        return f"{lead}: {report.fault_message}"
    if report.culprit_message:
        return f"{prefix}gradient check failed at step {report.step}: {report.culprit_message}"
    return f"{prefix}gradient check failed at step {report.step} ({_counts(report)})"


def _counts(report: CheckReport) -> str:
    counts = f"{len(report.failures)} of {len(report.probes)} probes failed"
    ratio = report.descent_ratio
    return counts + (f"; descent ratio {ratio:.6g}, 1 for a correct gradient" if math.isfinite(ratio) else "")


def _number(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else str(value)


def _cells(probe: Probe) -> tuple[str, ...]:
    return (
        probe.kind,
        probe.location,
        _number(probe.analytic, ".6g"),
        _number(probe.numeric, ".6g"),
        _number(probe.rel_error, ".3g"),
        _number(probe.noise, ".2g"),
        probe.reason,
    )


def probe_table(probes: Sequence[Probe]) -> str:
    """The probes as an aligned plain-text table, one row per probe under a header and a rule.

    Args:
        probes: The probes to show, e.g. ``report.probes``.
    """
    rows = [_TABLE_HEADER, *(_cells(p) for p in probes)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_TABLE_HEADER))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _more(hidden: int) -> list[str]:
    return [f"... and {hidden} more"] if hidden > 0 else []


def render_text(
    report: CheckReport, *, limit: int | None = DEFAULT_LIMIT, prefix: str = "gradwatch: ", table: bool = False
) -> str:
    """A failing report as plain text: the headline (with the culprit), the failing probes (at most ``limit``,
    ``None`` for all; one :meth:`Probe.describe` line each, or an aligned table with ``table=True``), "... and N
    more", the count of the culprit search's failing probes (the culprit says what they found), then the surrogate
    findings and the notes, each on a line of its own.

    Example::

        gradwatch: gradient check failed at step 3: the backward of `norm` (`RMSNorm`) is wrong: ...
          (4 of 9 probes failed)
          tensor fc.weight: analytic 1.02, numeric 0.98 (± 1e-06), rel. error 0.04 -> fail (discrepancy)
          ... and 3 more
          surrogate: ...
          note: ...
    """
    failures = [p for p in report.failures if not searches(p.kind)]
    shown = failures if limit is None else failures[: max(limit, 0)]
    lines = [headline(report, prefix)]
    if report.culprit_message:
        lines.append(f"  ({_counts(report)})")
    if table and shown:
        lines += [f"  {line}" for line in probe_table(shown).splitlines()]
    else:
        lines += [f"  {probe.describe()}" for probe in shown]
    lines += [f"  {line}" for line in _more(len(failures) - len(shown))]
    searched = len(report.failures) - len(failures)
    if searched:
        lines.append(f"  (and {searched} failing probe{'s' if searched > 1 else ''} of the culprit search)")
    lines += [f"  surrogate: {finding}" for finding in report.surrogates]
    lines += [f"  note: {note}" for note in report.notes]
    return "\n".join(lines)


def render_markdown(report: CheckReport, *, limit: int | None = None) -> str:
    """A failing report as markdown: a heading, the :data:`CULPRIT_PREFIX` line, a table of the failing probes (all of
    them by default) with the columns :data:`MARKDOWN_COLUMNS`, then the surrogate findings and the notes as bullets.
    An empty string when no probe failed."""
    failures = ordered_failures(report)
    if not failures:
        return ""
    shown = failures if limit is None else failures[: max(limit, 0)]
    rows = [
        f"gradient check **failed** at step {report.step}: {len(failures)} of {len(report.probes)} probes",
        "",
        *([f"{CULPRIT_PREFIX}{report.culprit_message}", ""] if report.culprit_message else []),
        "| " + " | ".join(MARKDOWN_COLUMNS) + " |",
        "|" + "---|" * len(MARKDOWN_COLUMNS),
    ]
    for probe in shown:
        index = "" if probe.index is None else ", ".join(str(i) for i in probe.index)
        target = (probe.target or "(the model)").replace("|", "\\|")
        rows.append(
            f"| {probe.kind} | `{target}` | {index} | {_number(probe.analytic, '.6g')} | "
            f"{_number(probe.numeric, '.6g')} | {_number(probe.rel_error, '.3g')} | {_number(probe.noise, '.2g')} | "
            f"{probe.reason} |"
        )
    rows += _more(len(failures) - len(shown))
    bullets = [f"* {finding}" for finding in report.surrogates] + [f"* note: {note}" for note in report.notes]
    rows += ["", *bullets] if bullets else []
    return "\n".join(rows)
