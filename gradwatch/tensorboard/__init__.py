"""TensorBoard: writing check reports (:mod:`.writer`), the dashboard's custom-scalars layout (:mod:`.dashboard`)
and reading gradwatch's results back from event files (:mod:`.events`). It imports the engine's report only."""

from gradwatch.tensorboard.writer import (
    FAILURES_TAG,
    HISTOGRAM_TAG,
    LOG10_FLOOR,
    SummaryWriterLike,
    failures_markdown,
    rel_error_log10,
    write_report,
)

__all__ = [
    "FAILURES_TAG",
    "HISTOGRAM_TAG",
    "LOG10_FLOOR",
    "SummaryWriterLike",
    "failures_markdown",
    "rel_error_log10",
    "write_report",
]
