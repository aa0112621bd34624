"""What a check writes to TensorBoard (:class:`~gradwatch.outputs.sinks.SummaryWriterSink` over the writer's tags):
histogram values, failure table, fixed tags."""

from __future__ import annotations

import math

import pytest
import torch

from gradwatch.engine.results.rendering import rel_error_log10, render_markdown
from gradwatch.engine.results.report import CheckReport, Probe
from gradwatch.outputs import SummaryWriterSink, records_of
from gradwatch.tensorboard.writer import FAILURES_TAG, HISTOGRAM_TAG


def _probe(
    verdict: str, rel_error: float, target: str = "layer.weight", index: tuple[int, ...] | None = (2, 3)
) -> Probe:
    return Probe("param", target, index, 1.0, 1.0 + rel_error, rel_error, verdict=verdict, noise=1e-6, step=1e-3,
                 reason="agrees")  # type: ignore[arg-type]  # fmt: skip


def _report(*probes: Probe) -> CheckReport:
    verdict = "fail" if any(p.verdict == "fail" for p in probes) else "ok"
    return CheckReport(
        step=7, verdict=verdict, probes=list(probes), loss=0.5, n_forward=10, n_backward=1, duration_s=0.1
    )


class FakeWriter:
    def __init__(self) -> None:
        self.histograms: list[tuple[str, torch.Tensor, int]] = []
        self.texts: list[tuple[str, str, int]] = []

    def add_histogram(self, tag: str, values: torch.Tensor, global_step: int) -> None:
        self.histograms.append((tag, values, global_step))

    def add_text(self, tag: str, text_string: str, global_step: int) -> None:
        self.texts.append((tag, text_string, global_step))


def _write(writer: FakeWriter, report: CheckReport) -> None:
    SummaryWriterSink(writer, scalars=False).write(records_of(report))


def test_histogram_holds_log10_of_conclusive_probes_only() -> None:
    report = _report(_probe("ok", 1e-5), _probe("ok", 0.0), _probe("inconclusive", 0.3), _probe("ok", 1e-2))
    assert rel_error_log10(report) == pytest.approx([-5.0, -12.0, -2.0])
    writer = FakeWriter()
    _write(writer, report)
    assert [(tag, step) for tag, _, step in writer.histograms] == [(HISTOGRAM_TAG, 7)]
    assert writer.texts == []


def test_failures_table_names_tensor_index_and_both_derivatives() -> None:
    report = _report(_probe("ok", 1e-6), _probe("fail", 0.05, "encoder.attn.weight", (4, 1)))
    table = render_markdown(report)
    assert "failed** at step 7: 1 of 2 probes" in table
    assert "| param | `encoder.attn.weight` | 4, 1 | 1 | 1.05 | 0.05 |" in table
    writer = FakeWriter()
    _write(writer, report)
    assert writer.texts == [(FAILURES_TAG, table, 7)]


def test_nothing_to_histogram_writes_nothing() -> None:
    writer = FakeWriter()
    _write(writer, _report(_probe("inconclusive", math.inf)))
    assert writer.histograms == []
    assert render_markdown(_report()) == ""
