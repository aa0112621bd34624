"""A sink per output backend, each writing what its backend can show of a check's :class:`CheckRecords`: TensorBoard
(:class:`SummaryWriterSink`), any backend with a text call (:class:`TextSink`), the backend-neutral JSON lines record
(:class:`JsonLinesSink`), a loop's own logging call (:class:`LogCallSink`), and any sink whose files may fail
(:class:`GuardedSink`). Adding a backend is one class here with ``write`` and ``flush`` (the :class:`Sink` protocol).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from gradwatch.outputs.jsonl import record_json
from gradwatch.outputs.records import CheckRecords
from gradwatch.tensorboard.writer import SummaryWriterLike, write_histogram

log = logging.getLogger(__name__)

_failed_sinks: set[str] = set()
"""Sinks (by their ``repr``, a file's path) that could not be written, warned about once per process."""


class Sink(Protocol):
    """Where the records of each check go."""

    def write(self, records: CheckRecords) -> None:
        """Record one check."""

    def flush(self) -> None:
        """Make what was written durable (called at once after a failing check)."""


class SummaryWriterSink:
    """TensorBoard through a ``torch.utils.tensorboard.SummaryWriter`` (or anything with its ``add_*`` methods).

    Args:
        writer: The writer (a Lightning ``TensorBoardLogger``'s ``experiment``).
        scalars: Also write the scalars; ``False`` where a logger's ``log_metrics`` already sends them.
        text: Also write the failure text; ``False`` where a logger already sends it.
        prefix: Put before every tag, to sit beside the tags a logger writes (a Hugging Face Trainer's ``"train/"``).
    """

    def __init__(self, writer: SummaryWriterLike, *, scalars: bool = True, text: bool = True, prefix: str = "") -> None:
        self.writer = writer
        self.scalars = scalars
        self.text = text
        self.prefix = prefix

    def write(self, records: CheckRecords) -> None:
        if self.scalars:
            add_scalar = self.writer.add_scalar  # type: ignore[attr-defined]
            for tag, value in records.scalars.items():
                add_scalar(self.prefix + tag, value, records.step)
        for tag, values in records.histograms.items():
            write_histogram(self.writer, values, records.step, self.prefix + tag)
        if self.text:  # the failure text and the labels, as a TextSink sends them
            TextSink(lambda tag, text, step: self.writer.add_text(self.prefix + tag, text, step)).write(records)

    def flush(self) -> None:
        flush = getattr(self.writer, "flush", None)
        if callable(flush):
            flush()


class TextSink:
    """The failure text through a backend's own text call, ``log_text(tag, text, step)``, when a check failed, and the
    records' labels (a failing applied check's fault in words).

    Args:
        log_text: Called with the records' ``text_tag`` (:data:`~gradwatch.tensorboard.writer.FAILURES_TAG` for a
            recomputed check), the markdown text and the step.
    """

    def __init__(self, log_text: Callable[[str, str, int], object]) -> None:
        self.log_text = log_text

    def write(self, records: CheckRecords) -> None:
        if records.text:
            self.log_text(records.text_tag, records.text, records.step)
        for tag, label in records.labels.items():
            self.log_text(tag, label, records.step)

    def flush(self) -> None:
        """Nothing to do: the backend sends what it was given."""


class JsonLinesSink:
    """One JSON object per check appended to ``path`` (see :mod:`gradwatch.outputs.jsonl`), flushed at once.

    The file is opened for each check and closed after it, so a sink holds no file handle (it pickles, survives a
    fork, and a run killed between checks leaves only whole lines). The directory is created when missing.

    Args:
        path: The file, by convention ``<log_dir>/gradwatch.jsonl`` (:data:`~gradwatch.outputs.jsonl.JSONL_NAME`).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def write(self, records: CheckRecords) -> None:
        line = json.dumps(record_json(records), allow_nan=False, ensure_ascii=False) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as file:
            file.write(line)  # one write per record: a reader never sees half a line of a run that goes on

    def flush(self) -> None:
        """Nothing to do: each record is flushed (the file closed) as it is written."""

    def __repr__(self) -> str:
        return f"JsonLinesSink({str(self.path)!r})"


class LogCallSink:
    """The scalars through a loop's own logging call, ``log(values, step)`` (a Hugging Face ``trainer.log``, which
    reaches every ``report_to`` integration; Fabric's ``log_dict``; Accelerate's ``log``), and the failure text too
    when ``text`` is set.

    Args:
        log: Called once per check with the ``gradwatch/*`` scalars (finite ones, the ``*_log10`` forms included) and
            the step the check ran at.
        text: Also send the failure text, under the records' ``text_tag``, when a check failed (a string value: for a
            call whose backends show strings; a console printer prints it whole).
    """

    def __init__(self, log: Callable[[dict[str, float | str], int], object], *, text: bool = False) -> None:
        self.log = log
        self.text = text

    def write(self, records: CheckRecords) -> None:
        values: dict[str, float | str] = dict(records.scalars)
        if self.text and records.text:
            values[records.text_tag] = records.text
        if self.text:
            values.update(records.labels)
        self.log(values, records.step)

    def flush(self) -> None:
        """Nothing to do: the loop sends what it was given."""


class GuardedSink:
    """A sink whose ``OSError`` (a full disk, a read-only directory) is logged once, as a warning naming the sink, and
    never raised: an output must not end the training run it records.

    Args:
        sink: The sink to guard (a :class:`JsonLinesSink`, a writer's sink).
    """

    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    def write(self, records: CheckRecords) -> None:
        self._guarded(self.sink.write, records)

    def flush(self) -> None:
        self._guarded(self.sink.flush)

    def _guarded(self, call: Callable[..., None], *arguments: CheckRecords) -> None:
        try:
            call(*arguments)
        except OSError as error:
            if repr(self.sink) not in _failed_sinks:  # once per file (a sink's repr names it) and process
                _failed_sinks.add(repr(self.sink))
                message = "gradwatch: could not write to %r (%s); training goes on, the record is incomplete"
                log.warning(message, self.sink, error)

    @property
    def failed(self) -> bool:
        """Whether writing to the sink failed in this process."""
        return repr(self.sink) in _failed_sinks

    def __repr__(self) -> str:
        return f"GuardedSink({self.sink!r})"


def write_to_sinks(sinks: Iterable[Sink], records: CheckRecords) -> None:
    """Write ``records`` to every sink, each guarded (:class:`GuardedSink`), flushed at once when the check failed."""
    for sink in sinks:
        guarded = sink if isinstance(sink, GuardedSink) else GuardedSink(sink)
        guarded.write(records)
        if records.failed:
            guarded.flush()
