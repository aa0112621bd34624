"""Writing check reports to TensorBoard: per-probe histograms and a table of failing probes.

Scalars (:meth:`gradwatch.engine.results.report.CheckReport.scalars`) go through a logger's ``log_metrics`` like any
other
metric; this module adds what only TensorBoard shows, through a ``torch.utils.tensorboard.SummaryWriter`` (or anything
with ``add_histogram`` and ``add_text``). The tags are fixed and few, whatever coordinates were sampled:

* ``gradwatch/rel_error_log10`` (histogram): log10 of the relative error of every conclusive probe;
* ``gradwatch/failures`` (text): the failing report in markdown
  (:func:`gradwatch.engine.results.rendering.render_markdown`:
  the culprit, a table of the failing probes), only when some failed.
"""

from __future__ import annotations

from typing import Protocol

import torch

from gradwatch.engine.results.rendering import CULPRIT_PREFIX, LOG10_FLOOR, rel_error_log10, render_markdown
from gradwatch.engine.results.report import CheckReport

HISTOGRAM_TAG = "gradwatch/rel_error_log10"
FAILURES_TAG = "gradwatch/failures"
APPLIED_PREFIX = "gradwatch/applied/"
"""The applied checks' scalars are logged under this prefix, apart from the recomputed checks' ``gradwatch/*``."""
CLIPPING_PREFIX = APPLIED_PREFIX + "clipping/"
"""The clip coefficient's check (``watch.after_clipping``) logs its scalars under this prefix: its step is the applied
check's, and one tag for both would let the later record stand in place of the other."""
APPLIED_FAILURE_TAG = APPLIED_PREFIX + "failure"
"""The text of a failing applied check, led by the fault."""
UPDATE_PREFIX = "gradwatch/update/"
"""The update checks' scalars are logged under this prefix (:mod:`gradwatch.engine.update`)."""
UPDATE_FAILURE_TAG = UPDATE_PREFIX + "failure"
"""The text of a failing update check, led by the fault."""
TRAINER_PREFIX = "train/"
"""A Hugging Face Trainer's TensorBoard run holds the tags of its training logs under this prefix (its
``rewrite_logs``: ``train/gradwatch/verdict``); gradwatch writes its histograms and texts there beside them, and
:mod:`gradwatch.tensorboard.events` reads them as the same tags without it."""

__all__ = [
    "CULPRIT_PREFIX",
    "FAILURES_TAG",
    "HISTOGRAM_TAG",
    "LOG10_FLOOR",
    "UPDATE_FAILURE_TAG",
    "UPDATE_PREFIX",
    "SummaryWriterLike",
    "failures_markdown",
    "rel_error_log10",
    "write_report",
]


class SummaryWriterLike(Protocol):
    def add_histogram(self, tag: str, values: torch.Tensor, global_step: int) -> object: ...

    def add_text(self, tag: str, text_string: str, global_step: int) -> object: ...


def failures_markdown(report: CheckReport) -> str:
    """The failing probes of a report as markdown, culprit first (empty string when none failed)."""
    return render_markdown(report)


def write_histogram(writer: SummaryWriterLike, values: list[float], step: int, tag: str = HISTOGRAM_TAG) -> None:
    """Add ``values`` as a histogram at ``step`` (nothing when there are none)."""
    if values:
        writer.add_histogram(tag, torch.tensor(values, dtype=torch.float64), step)


def write_report(writer: SummaryWriterLike, report: CheckReport, step: int) -> None:
    """Add the report's histogram and, if it failed, its failure table, at ``step``."""
    write_histogram(writer, rel_error_log10(report), step)
    table = failures_markdown(report)
    if table:
        writer.add_text(FAILURES_TAG, table, step)
