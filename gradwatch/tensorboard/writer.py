"""TensorBoard's tags for gradwatch, and the writing of a histogram (:class:`gradwatch.outputs.sinks.SummaryWriterSink`
writes a check's records through it).

Scalars go through a logger's ``log_metrics`` like any other metric; TensorBoard also shows, through a
``SummaryWriter`` (or anything with ``add_histogram`` and ``add_text``), the histogram of every conclusive probe's log10
relative error (:data:`HISTOGRAM_TAG`) and a failing report in markdown (:data:`FAILURES_TAG`:
:func:`gradwatch.engine.results.rendering.render_markdown`). The tags are fixed and few, whatever was sampled.
"""

from __future__ import annotations

from typing import Protocol

import torch

PREFIX = "gradwatch/"
VERDICT_TAG = PREFIX + "verdict"
HISTOGRAM_TAG = "gradwatch/rel_error_log10"
FAILURES_TAG = "gradwatch/failures"
APPLIED_PREFIX = "gradwatch/applied/"
"""The applied checks' scalars are logged under this prefix, apart from the recomputed checks' ``gradwatch/*``."""
CLIPPING_PREFIX = APPLIED_PREFIX + "clipping/"
"""The clip coefficient's check (``watch.after_clipping``) logs its scalars under this prefix: its step is the applied
check's, and one tag for both would let the later record stand in place of the other."""
APPLIED_VERDICT_TAG = APPLIED_PREFIX + "verdict"
CLIPPING_VERDICT_TAG = CLIPPING_PREFIX + "verdict"
APPLIED_FAILURE_TAG = APPLIED_PREFIX + "failure"
"""The text of a failing applied check, led by the fault."""
UPDATE_PREFIX = "gradwatch/update/"
"""The update checks' scalars are logged under this prefix (:mod:`gradwatch.engine.update`)."""
UPDATE_FAILURE_TAG = UPDATE_PREFIX + "failure"
"""The text of a failing update check, led by the fault."""
TRAINER_PREFIX = "train/"
"""A Hugging Face Trainer's TensorBoard run holds the tags of its training logs under this prefix (its
``rewrite_logs``: ``train/gradwatch/verdict``); gradwatch writes its histograms and texts there beside them."""

__all__ = [
    "APPLIED_PREFIX",
    "FAILURES_TAG",
    "HISTOGRAM_TAG",
    "UPDATE_FAILURE_TAG",
    "UPDATE_PREFIX",
    "VERDICT_TAG",
    "SummaryWriterLike",
    "write_histogram",
]


class SummaryWriterLike(Protocol):
    def add_histogram(self, tag: str, values: torch.Tensor, global_step: int) -> object: ...

    def add_text(self, tag: str, text_string: str, global_step: int) -> object: ...


def write_histogram(writer: SummaryWriterLike, values: list[float], step: int, tag: str = HISTOGRAM_TAG) -> None:
    """Add ``values`` as a histogram at ``step`` (nothing when there are none)."""
    if values:
        writer.add_histogram(tag, torch.tensor(values, dtype=torch.float64), step)
