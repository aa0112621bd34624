"""TensorBoard: the tags gradwatch writes and the writing of its histograms (:mod:`.writer`), and the dashboard's
custom-scalars layout (:mod:`.dashboard`). It imports no other part of gradwatch; ``gradwatch report`` reads the
JSON lines record, not the event files."""

from gradwatch.tensorboard.writer import FAILURES_TAG, HISTOGRAM_TAG, SummaryWriterLike, write_histogram

__all__ = ["FAILURES_TAG", "HISTOGRAM_TAG", "SummaryWriterLike", "write_histogram"]
