"""Outputs: one place turns a check's report into records (:mod:`.records`), a sink per backend writes them
(:mod:`.sinks`: TensorBoard, text-capable loggers, a JSON lines record beside the logs), and :mod:`.reading` reads a
log directory's JSON lines records back for ``gradwatch report``. Above :mod:`gradwatch.tensorboard`, below the
adapters of the training loops."""

from gradwatch.outputs.jsonl import JSONL_NAME
from gradwatch.outputs.records import CheckRecords, applied_records_of, records_of
from gradwatch.outputs.sinks import GuardedSink, JsonLinesSink, LogCallSink, Sink, SummaryWriterSink, TextSink

__all__ = [
    "JSONL_NAME",
    "CheckRecords",
    "GuardedSink",
    "JsonLinesSink",
    "LogCallSink",
    "Sink",
    "SummaryWriterSink",
    "TextSink",
    "applied_records_of",
    "records_of",
]
