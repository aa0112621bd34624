"""The sinks: TensorBoard through a SummaryWriter, text-capable backends, and the JSON lines record."""

from __future__ import annotations

import dataclasses
import json
import math
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SeedModel, seed_batch, seed_loss

from gradwatch import check_gradients
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import CheckReport, Probe
from gradwatch.outputs import GuardedSink, JsonLinesSink, LogCallSink, SummaryWriterSink, TextSink, records_of
from gradwatch.outputs.jsonl import parse_record, record_json
from gradwatch.outputs.records import FAULT_NAME_TAG, applied_records_of
from gradwatch.tensorboard.writer import FAILURES_TAG, HISTOGRAM_TAG


class FakeWriter:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self.flushed = 0

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        self.calls.append(("scalar", tag, global_step))

    def add_histogram(self, tag: str, values: torch.Tensor, global_step: int) -> None:
        self.calls.append(("histogram", tag, global_step))

    def add_text(self, tag: str, text_string: str, global_step: int) -> None:
        self.calls.append(("text", tag, global_step))

    def flush(self) -> None:
        self.flushed += 1


@pytest.fixture(scope="module")
def failing() -> CheckReport:
    report = check_gradients(SeedModel(weight_scale=1.1), seed_batch(), seed_loss, step=4)
    return dataclasses.replace(report, culprit_message="the backward of `fc` is wrong", culprits=["fc", ""])


@pytest.mark.parametrize("scalars", [True, False], ids=["with-scalars", "without-scalars"])
def test_summary_writer_sink_writes_histogram_text_and_optionally_scalars(failing: CheckReport, scalars: bool) -> None:
    writer = FakeWriter()
    sink = SummaryWriterSink(writer, scalars=scalars)
    records = records_of(failing)
    sink.write(records)
    sink.flush()
    kinds = [(kind, tag) for kind, tag, step in writer.calls if step == 4]
    assert len(kinds) == len(writer.calls)
    assert ("histogram", HISTOGRAM_TAG) in kinds
    assert ("text", FAILURES_TAG) in kinds
    assert sum(kind == "scalar" for kind, _ in kinds) == (len(records.scalars) if scalars else 0)
    assert writer.flushed == 1


def test_text_sink_gets_the_failure_text_only(failing: CheckReport) -> None:
    received: list[tuple[str, str, int]] = []
    sink = TextSink(lambda tag, text, step: received.append((tag, text, step)))
    sink.write(records_of(failing))
    sink.write(records_of(check_gradients(SeedModel(), seed_batch(), seed_loss)))  # a healthy check: no text
    ((tag, text, step),) = received
    assert (tag, step) == (FAILURES_TAG, 4)
    assert text.splitlines()[2] == "culprit: the backward of `fc` is wrong"


class Scope(Enum):
    OPTIMIZER = "optimizer"


@dataclasses.dataclass(frozen=True, slots=True)
class ScopedReport(CheckReport):
    """A report with the attributes other parts of gradwatch add (read through getattr)."""

    scope: Scope = Scope.OPTIMIZER
    fault: Any = None


def _strict(line: str) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_json_lines_sink_appends_one_valid_json_object_per_check(tmp_path: Path, failing: CheckReport) -> None:
    path = tmp_path / "run" / "gradwatch.jsonl"
    sink = JsonLinesSink(path)
    bad = Probe("param", "w", (1, 2), math.nan, math.inf, math.nan, verdict="fail", noise=-math.inf, step=1e-3,
                reason="nonfinite")  # type: ignore[arg-type]  # fmt: skip
    fields = {f.name: getattr(failing, f.name) for f in dataclasses.fields(CheckReport)}
    fields.update(probes=[*failing.probes, bad], fault={"at": "loss", "value": math.nan}, scope=Scope.OPTIMIZER)
    reports = [failing, ScopedReport(**fields)]
    for report in reports:
        sink.write(records_of(report, overhead=0.01))
        sink.flush()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    first, second = (_strict(line) for line in lines)
    assert first == _strict(json.dumps(record_json(records_of(failing, overhead=0.01))))
    expected = (4, "fail", failing.culprit_message, ["fc", ""])
    assert (first["step"], first["verdict"], first["culprit"], first["culprits"]) == expected
    assert first["scalars"]["gradwatch/overhead"] == 0.01
    assert first["notes"] == [str(note) for note in failing.notes]
    assert first["note_codes"] == [str(note.code) for note in failing.notes]  # type: ignore[attr-defined]
    assert first["notes"]  # the seed model's custom Function cannot be vectorised: a note with its code
    assert first["scope"] == "recomputed"  # every report has a scope (issue 23); a fault only when one was named
    assert "fault" not in first
    assert second["scope"] == "optimizer"
    assert second["fault"] == {"at": "loss", "value": "nan"}
    written = next(f for f in second["failures"] if f["target"] == "w")  # the culprit search's probes come last
    assert (written["analytic"], written["numeric"], written["noise"], written["index"]) == (
        "nan",
        "inf",
        "-inf",
        [1, 2],
    )
    check, failures, culprit = parse_record(second)
    assert check.verdict == "fail"
    assert check.step == 4
    assert culprit == failing.culprit_message
    added = next(f for f in failures if f.tensor == "w")
    assert math.isnan(added.analytic)
    assert added.numeric == math.inf
    assert added.index == "1, 2"
    assert len(failures) == len(failing.failures) + 1


def test_the_json_record_carries_each_notes_code(failing: CheckReport) -> None:
    notes = [Note(NoteCode.WHOLE_BATCH, "probes use the whole batch"), "a plain remark"]
    record = json.loads(json.dumps(record_json(records_of(dataclasses.replace(failing, notes=notes)))))
    assert record["notes"] == ["probes use the whole batch", "a plain remark"]
    assert record["note_codes"] == ["whole-batch", None]


def test_summary_writer_sink_with_a_prefix_and_without_text(failing: CheckReport) -> None:
    writer = FakeWriter()
    SummaryWriterSink(writer, scalars=False, text=False, prefix="train/").write(records_of(failing))
    assert writer.calls == [("histogram", "train/" + HISTOGRAM_TAG, 4)]


@pytest.mark.parametrize("text", [False, True], ids=["scalars", "scalars-and-text"])
def test_log_call_sink_sends_the_scalars_in_one_call(failing: CheckReport, text: bool) -> None:
    calls: list[tuple[dict[str, float | str], int]] = []
    records = records_of(failing, overhead=0.5)
    LogCallSink(lambda values, step: calls.append((values, step)), text=text).write(records)
    ((values, step),) = calls
    assert step == 4
    assert {tag: value for tag, value in values.items() if tag != FAILURES_TAG} == records.scalars
    assert "gradwatch/rel_error_max_log10" in values
    assert values["gradwatch/overhead"] == 0.5
    assert values.get(FAILURES_TAG) == (records.text if text else None)


def test_guarded_sink_warns_once_and_never_raises(failing: CheckReport, tmp_path: Path, caplog) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    sink = GuardedSink(JsonLinesSink(blocked / "gradwatch.jsonl"))  # its directory is a file
    with caplog.at_level("WARNING", logger="gradwatch.outputs.sinks"):
        sink.write(records_of(failing))
        sink.write(records_of(failing))
        sink.flush()
    assert sink.failed
    (warning,) = [record.getMessage() for record in caplog.records]
    assert "could not write to JsonLinesSink(" in warning
    assert "training goes on" in warning


def test_the_fault_of_a_failing_applied_check_reaches_the_text_backends_in_words(failing: CheckReport) -> None:
    applied = dataclasses.replace(failing, scope="applied").with_findings(
        fault="accumulation", fault_message="summed twice"
    )
    records = applied_records_of(applied)
    writer = FakeWriter()
    SummaryWriterSink(writer).write(records)
    assert ("text", FAULT_NAME_TAG, 4) in writer.calls
    texts: list[tuple[str, str, int]] = []
    TextSink(lambda tag, text, step: texts.append((tag, text, step))).write(records)
    assert (FAULT_NAME_TAG, "accumulation", 4) in texts
    calls: list[tuple[dict[str, float | str], int]] = []
    LogCallSink(lambda values, step: calls.append((values, step)), text=True).write(records)
    assert calls[0][0][FAULT_NAME_TAG] == "accumulation"
    assert calls[0][0]["gradwatch/applied/fault"] == 5.0  # the numeric code stays beside it
    LogCallSink(lambda values, step: calls.append((values, step))).write(records)
    assert FAULT_NAME_TAG not in calls[1][0]  # a call whose backends show no strings gets numbers only
