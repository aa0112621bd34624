"""The custom-scalars dashboard: its layout names real tags, and a fit writes it once per run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import update_models
from helpers import LitSeedModel, SeedModel, loader, seed_batch, seed_loss, trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from gradwatch import CheckReport, GradWatch, check_gradients
from gradwatch.outputs.records import Overhead, applied_scalars, update_scalars
from gradwatch.tensorboard.dashboard import LAYOUT_TAG, REL_ERROR_TAGS, SECTIONS, layout, layout_tags, write_dashboard


class FakeWriter:
    def __init__(self) -> None:
        self.layouts: list[dict[str, dict[str, list[object]]]] = []

    def add_custom_scalars(self, layout: dict[str, dict[str, list[object]]]) -> None:
        self.layouts.append(layout)


def _linear(tag: str) -> str:
    """The report's scalar a charted tag shows (the relative errors are charted as their log10)."""
    return tag.removesuffix("_log10")


def _update_reports(make: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> list[CheckReport]:
    """The update checks of a real plain loop: a tiny MLP stepped by ``make(model)`` through ``GradientWatch``, an
    update check at each of its 3 steps."""
    return update_models.watched_loop(make, 3).update_reports


def test_every_charted_tag_is_a_scalar_of_the_report_its_log10_the_applied_or_update_checks_or_the_overhead() -> None:
    report = check_gradients(SeedModel(), seed_batch(), seed_loss)
    applied = set(
        applied_scalars(dataclasses.replace(report, scope="applied").with_findings(noise_floor=1e-6, floor_excess=0.1))
    )
    (update, *_) = _update_reports(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    assert update.scope == "update"
    assert update.verdict == "ok", str(update)
    updates = set(update_scalars(update))
    overhead = set(Overhead(0.5, 0.01, 2.0, 0.01).scalars())
    assert {_linear(tag) for tag in layout_tags()} <= set(report.scalars()) | applied | updates | overhead
    assert {"gradwatch/descent_ratio", "gradwatch/failing_probes", "gradwatch/inconclusive_probes"} <= layout_tags()
    charted = {"gradwatch/applied/verdict", "gradwatch/overhead_percent", "gradwatch/first_checks_seconds"}
    assert charted <= layout_tags()


def test_every_update_scalar_is_charted_in_the_update_section_healthy_or_failing() -> None:
    """An AdamW's healthy update checks and a Muon's without its Newton-Schulz iteration (DeepSpeed PR#8442), whose
    every update check fails with fault ``update``: each logs every scalar the update section charts, and the section
    charts every one of them."""
    healthy = _update_reports(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    failing = _update_reports(
        lambda m: update_models.NoNewtonSchulzMuon([p for p in m.parameters() if p.ndim == 2], lr=0.02)
    )
    assert [r.verdict for r in healthy] == ["ok"] * 3, [str(r) for r in healthy]
    assert [(r.verdict, r.fault) for r in failing] == [("fail", "update")] * 3, [str(r) for r in failing]
    title, charts = SECTIONS[-1]
    assert "update" in title
    charted = {tag for _, _, tags in charts for tag in tags}
    for report in (*healthy, *failing):
        assert set(update_scalars(report)) == charted
    assert update_scalars(failing[0])["gradwatch/update/verdict"] == 2.0
    assert update_scalars(failing[0])["gradwatch/update/floor_excess"] > 1
    assert update_scalars(healthy[0])["gradwatch/update/floor_excess"] < 1


def test_the_relative_error_is_charted_on_a_log_scale() -> None:
    assert all(tag.endswith("_log10") for tag in REL_ERROR_TAGS)


def test_margin_band_is_min_to_max_around_the_median() -> None:
    scalars = check_gradients(SeedModel(weight_scale=1.1), seed_batch(), seed_loss).scalars()
    median, low, high = (scalars[_linear(tag)] for tag in REL_ERROR_TAGS)
    assert low <= median <= high
    assert low < high  # a failing check mixes agreeing probes with a 5% error
    charts = [chart for section in layout().values() for chart in section.values()]
    assert ["Margin", list(REL_ERROR_TAGS)] in charts
    first_section = next(iter(layout().values()))
    # the reverse of the order shown: TensorBoard draws a section's Margin charts last first
    assert list(first_section.values()) == [
        ["Margin", ["gradwatch/applied/verdict"] * 3],
        ["Margin", ["gradwatch/verdict"] * 3],
    ]
    assert [title for _, _, tags in SECTIONS[0][1] for title in [tags[0]]] == [
        "gradwatch/verdict",
        "gradwatch/applied/verdict",
    ]


def test_every_chart_draws_a_lone_point() -> None:
    """TensorBoard scales a line chart without its outliers: one point per run drew an empty Multiline chart, while a
    Margin chart draws each (seen in headless Chromium); every chart is a Margin chart, one tag's with the value as its
    band."""
    for section in layout().values():
        for kind, tags in section.values():
            assert kind == "Margin"
            assert len(tags) == 3  # type: ignore[arg-type]


def test_multiline_expressions_are_anchored() -> None:
    for kind, tags in (chart for charts in layout().values() for chart in charts.values()):
        if kind == "Multiline":
            assert all(str(tag).startswith("^gradwatch/") and str(tag).endswith("$") for tag in tags)  # type: ignore[attr-defined]


def test_write_dashboard_writes_the_layout() -> None:
    writer = FakeWriter()
    write_dashboard(writer)
    assert writer.layouts == [layout()]


@pytest.mark.slow
def test_fit_writes_the_layout_once_and_tensorboard_parses_it(tmp_path: Path) -> None:
    logger = TensorBoardLogger(str(tmp_path), name="run", default_hp_metric=False)
    trainer(tmp_path, [GradWatch(every_n_steps=2, max_overhead=None)], logger=logger, max_steps=4).fit(
        LitSeedModel(), loader(seed_batch(), 4)
    )
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    stored = events.Tensors(LAYOUT_TAG)
    assert len(stored) == 1
    parsed = layout_pb2.Layout()
    parsed.ParseFromString(stored[0].tensor_proto.string_val[0])
    assert [category.title for category in parsed.category] == [section for section, _ in SECTIONS]
    charts = [chart for category in parsed.category for chart in category.chart]
    margins = [chart.margin.series[0] for chart in charts if chart.HasField("margin")]
    assert [(m.value, m.lower, m.upper) for m in margins] == [
        tags for _, charts in SECTIONS for _, _, tags in reversed(charts)
    ]
    assert REL_ERROR_TAGS in [(m.value, m.lower, m.upper) for m in margins]
    assert len(charts) == len(margins) == sum(len(charts) for _, charts in SECTIONS) == 18
    # every tag the dashboard draws was logged
    assert layout_tags() <= set(events.Tags()["scalars"])
