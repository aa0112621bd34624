"""Writing check reports to TensorBoard: per-probe histograms and a table of failing probes.

Scalars (:meth:`gradwatch.engine.report.CheckReport.scalars`) go through a logger's ``log_metrics`` like any other
metric; this module adds what only TensorBoard shows, through a ``torch.utils.tensorboard.SummaryWriter`` (or anything
with ``add_histogram`` and ``add_text``). The tags are fixed and few, whatever coordinates were sampled:

* ``gradwatch/rel_error_log10`` (histogram): log10 of the relative error of every conclusive probe;
* ``gradwatch/failures`` (text): a markdown table of the failing probes of a check, only when some failed.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from gradwatch.engine.report import CheckReport

HISTOGRAM_TAG = "gradwatch/rel_error_log10"
FAILURES_TAG = "gradwatch/failures"
CULPRIT_PREFIX = "culprit: "
"""The line of the failures text that names the module whose backward is wrong (read back by ``gradwatch report``)."""
LOG10_FLOOR = -12.0
"""Relative errors below 1e-12 (exact agreement included) are shown at -12."""


class SummaryWriterLike(Protocol):
    def add_histogram(self, tag: str, values: torch.Tensor, global_step: int) -> object: ...

    def add_text(self, tag: str, text_string: str, global_step: int) -> object: ...


def rel_error_log10(report: CheckReport) -> list[float]:
    """log10 of the relative errors of the report's conclusive probes, floored at :data:`LOG10_FLOOR`."""
    return [
        max(math.log10(error), LOG10_FLOOR) if error > 0 else LOG10_FLOOR
        for error in report.conclusive_rel_errors
        if math.isfinite(error)
    ]


def failures_markdown(report: CheckReport) -> str:
    """The failing probes of a report as a markdown table (empty string when none failed)."""
    if not report.failures:
        return ""
    rows = [
        f"gradient check **failed** at step {report.step}: {len(report.failures)} of {len(report.probes)} probes",
        "",
        *([f"{CULPRIT_PREFIX}{report.culprit_message}", ""] if report.culprit_message else []),
        "| kind | tensor | index | analytic | numeric | rel. error | noise | reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for probe in report.failures:
        index = "" if probe.index is None else ", ".join(str(i) for i in probe.index)
        target = probe.target or "(the model)"
        rows.append(
            f"| {probe.kind} | `{target}` | {index} | {probe.analytic:.6g} | {probe.numeric:.6g} | "
            f"{probe.rel_error:.3g} | {probe.noise:.2g} | {probe.reason} |"
        )
    rows += ["", *(f"* {finding}" for finding in report.surrogates)] if report.surrogates else []
    return "\n".join(rows)


def write_report(writer: SummaryWriterLike, report: CheckReport, step: int) -> None:
    """Add the report's histogram and, if it failed, its failure table, at ``step``."""
    values = rel_error_log10(report)
    if values:
        writer.add_histogram(HISTOGRAM_TAG, torch.tensor(values, dtype=torch.float64), step)
    table = failures_markdown(report)
    if table:
        writer.add_text(FAILURES_TAG, table, step)
