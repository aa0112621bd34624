"""Applied checks (``scope == "applied"``) through the outputs and back: their records (scalars under
``gradwatch/applied/``, the text led by the fault), the JSON lines record read back by ``gradwatch report``, failures
led by the fault, and the exit status they give."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
from helpers import SeedModel, seed_batch, seed_loss

from gradwatch import check_gradients
from gradwatch.cli import main
from gradwatch.engine.results.report import CheckReport
from gradwatch.errors import ReportInputError
from gradwatch.outputs import JsonLinesSink, applied_records_of, records_of
from gradwatch.outputs.reading import read_jsonl
from gradwatch.tensorboard.writer import APPLIED_FAILURE_TAG, FAILURES_TAG

MESSAGE = "the applied gradient is 50% off under autocast and right without it"


@pytest.fixture(scope="module")
def healthy() -> CheckReport:
    return check_gradients(SeedModel(), seed_batch(), seed_loss)


@pytest.fixture(scope="module")
def applied_fail() -> CheckReport:
    report = check_gradients(SeedModel(weight_scale=1.1), seed_batch(), seed_loss)
    assert report.verdict == "fail"
    return dataclasses.replace(report, step=3, scope="applied").with_findings(
        fault="precision", fault_message=MESSAGE, noise_floor=2e-3, floor_excess=41.5
    )


def _applied(report: CheckReport, step: int, verdict: str = "ok") -> CheckReport:
    return dataclasses.replace(report, step=step, scope="applied", verdict=verdict).with_findings(
        fault=None, fault_message="", noise_floor=1e-3, floor_excess=0.2
    )


def _report(logdir: Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["report", str(logdir)])
    return code, out.getvalue()


def test_applied_records_lead_with_the_fault_under_their_own_tags(applied_fail: CheckReport) -> None:
    records = applied_records_of(applied_fail)
    assert records.text_tag == APPLIED_FAILURE_TAG
    assert records_of(applied_fail).text_tag == FAILURES_TAG
    assert records.text is not None
    assert records.text.splitlines()[0] == f"precision fault: applied gradient check failed at step 3: {MESSAGE}"
    assert records.scalars["gradwatch/applied/verdict"] == 2.0
    assert records.scalars["gradwatch/applied/fault"] == 2.0  # "precision", second of FAULTS
    assert records.scalars["gradwatch/applied/floor_excess"] == 41.5
    assert all(tag.startswith("gradwatch/applied/") for tag in records.scalars)
    assert not records.histograms
    assert applied_records_of(_applied(applied_fail, 4)).text is None


@pytest.mark.slow
def test_the_json_lines_record_reads_back_apart_from_the_recomputed_checks(
    tmp_path: Path, healthy: CheckReport, applied_fail: CheckReport
) -> None:
    sink = JsonLinesSink(tmp_path / "gradwatch.jsonl")
    sink.write(records_of(dataclasses.replace(healthy, step=3)))  # a recomputed check at the same step
    sink.write(applied_records_of(applied_fail))
    sink.write(applied_records_of(_applied(healthy, 6)))
    line = json.loads((tmp_path / "gradwatch.jsonl").read_text().splitlines()[1])
    assert (line["scope"], line["fault"], line["fault_message"]) == ("applied", "precision", MESSAGE)

    found = read_jsonl(tmp_path / "gradwatch.jsonl")
    assert [c.verdict for c in found.checks.values()] == ["ok"]
    assert [(a.step, a.verdict, a.fault) for a in found.applied.values()] == [(3, "fail", "precision"), (6, "ok", None)]
    assert found.applied[3].fault_message == MESSAGE
    assert found.applied[3].get("floor_excess") == 41.5

    code, out = _report(tmp_path)
    assert code == 1
    assert f"precision fault at step 3: {MESSAGE}" in out
    assert "result: FAIL" in out


@pytest.mark.slow
def test_a_malformed_applied_record_is_an_input_error(tmp_path: Path, applied_fail: CheckReport) -> None:
    path = tmp_path / "gradwatch.jsonl"
    JsonLinesSink(path).write(applied_records_of(applied_fail))
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "fault": "cosmic rays"}) + "\n")
    with pytest.raises(ReportInputError, match="line 1: 'fault' is 'cosmic rays'"):
        read_jsonl(path)
    code, out = _report(tmp_path)
    assert code == 2
    assert "'fault' is 'cosmic rays'" in out


@pytest.mark.slow
def test_exit_status_counts_applied_checks(tmp_path: Path, healthy: CheckReport) -> None:
    only_inconclusive = tmp_path / "inconclusive"
    JsonLinesSink(only_inconclusive / "gradwatch.jsonl").write(
        applied_records_of(_applied(healthy, 2, verdict="inconclusive"))
    )
    code, out = _report(only_inconclusive)
    assert code == 3
    assert "NOTHING CHECKED" in out

    ok = tmp_path / "ok"
    JsonLinesSink(ok / "gradwatch.jsonl").write(applied_records_of(_applied(healthy, 2)))
    code, out = _report(ok)
    assert code == 0
    assert "applied checks (the gradient the optimizer applied): 1, 1 ok, 0 inconclusive, 0 fail" in out
