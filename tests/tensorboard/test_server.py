"""End to end: the event files of a real ``Trainer.fit`` with GradWatch, served by a real TensorBoard server, and its
page rendered by a real (headless) Chromium.

The browser test needs Debian's ``chromium``. Without it the test is skipped, unless ``GRADWATCH_REQUIRE_BROWSER=1``
(set by ``.ci/run`` after installing it), where a missing browser fails the test instead.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import LitSeedModel, loader, seed_batch, trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard_browser import HeadlessChromium, TensorBoardServer, find_chromium, png_size

from gradwatch import CheckReport, GradWatch
from gradwatch.tensorboard.dashboard import REL_ERROR_TAGS, SECTIONS, layout_tags

RUN = "seed/version_0"
FAILURES_TEXT_TAG = "gradwatch/failures/text_summary"


pytestmark = pytest.mark.slow  # a Trainer fit, a TensorBoard server and a browser


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[CheckReport]]:
    """A short fit of a model with a wrong weight gradient (so the failure text exists): logdir and reports."""
    logdir = tmp_path_factory.mktemp("tensorboard_server")
    watch = GradWatch(every_n_steps=2, max_overhead=None, on_fail=lambda report: None)
    logger = TensorBoardLogger(str(logdir), name="seed", default_hp_metric=False)
    trainer(logdir, [watch], logger=logger, max_steps=4).fit(LitSeedModel(weight_scale=1.1), loader(seed_batch(), 4))
    return logdir, watch.recomputed_reports


@pytest.fixture(scope="module")
def server(fitted: tuple[Path, list[CheckReport]]) -> Iterator[TensorBoardServer]:
    with TensorBoardServer(fitted[0]) as running:  # stopped when the module's tests end, passed or failed
        # TensorBoard reads event files in the background: wait until it has read the last tag written
        running.wait_for("/data/plugin/text/tags", lambda tags: FAILURES_TEXT_TAG in tags.get(RUN, []))
        yield running
    assert running.process is None


def _query(**params: str) -> str:
    return urllib.parse.urlencode(params)


def test_server_serves_the_gradwatch_scalars(server: TensorBoardServer, fitted: tuple[Path, list[CheckReport]]) -> None:
    reports = fitted[1]
    tags = server.get_json("/data/plugin/scalars/tags")[RUN]
    assert set(reports[0].scalars()) <= set(tags)
    verdicts = server.get_json(f"/data/plugin/scalars/scalars?{_query(run=RUN, tag='gradwatch/verdict')}")
    assert (
        [(step, value) for _, step, value in verdicts]
        == [(r.step, 2.0) for r in reports]
        == [(1, 2.0), (2, 2.0), (4, 2.0)]
    )
    ratios = server.get_json(f"/data/plugin/scalars/scalars?{_query(run=RUN, tag='gradwatch/descent_ratio')}")
    assert [value for _, _, value in ratios] == pytest.approx([r.descent_ratio for r in reports], rel=1e-6)


def test_server_serves_the_histogram(server: TensorBoardServer) -> None:
    assert "gradwatch/rel_error_log10" in server.get_json("/data/plugin/histograms/tags")[RUN]
    histograms = server.get_json(
        f"/data/plugin/histograms/histograms?{_query(run=RUN, tag='gradwatch/rel_error_log10')}"
    )
    assert [step for _, step, _ in histograms] == [1, 2, 4]
    assert all(buckets for _, _, buckets in histograms)


def test_server_serves_the_failure_text(server: TensorBoardServer, fitted: tuple[Path, list[CheckReport]]) -> None:
    texts = server.get_json(f"/data/plugin/text/text?{_query(run=RUN, tag=FAILURES_TEXT_TAG)}")
    assert [entry["step"] for entry in texts] == [1, 2, 4]
    first = texts[0]["text"]  # rendered to HTML by TensorBoard
    assert "<strong>failed</strong> at step 1" in first
    assert "<th>analytic</th>" in first
    assert "<th>numeric</th>" in first
    assert "<code>net.fc.weight</code>" in first
    for probe in fitted[1][0].failures:
        assert f"<td>{probe.analytic:.6g}</td>" in first


def test_server_serves_the_dashboard_layout(server: TensorBoardServer) -> None:
    assert server.get_json("/data/plugins_listing")["custom_scalars"]["enabled"]
    layout = server.get_json("/data/plugin/custom_scalars/layout")
    assert [category["title"] for category in layout["category"]] == [title for title, _ in SECTIONS]
    # each section's charts stored last first: TensorBoard draws a section's Margin charts in reverse
    assert [[chart["title"] for chart in category["chart"]] for category in layout["category"]] == [
        [title for title, _, _ in reversed(charts)] for _, charts in SECTIONS
    ]
    margins = [chart["margin"]["series"][0] for c in layout["category"] for chart in c["chart"] if "margin" in chart]
    assert len(margins) == sum(len(charts) for _, charts in SECTIONS)  # every chart a Margin chart: a lone point shows
    assert {
        "value": "gradwatch/rel_error_median_log10",
        "lower": "gradwatch/rel_error_min_log10",
        "upper": "gradwatch/rel_error_max_log10",
    } in margins
    assert {"value": "gradwatch/verdict", "lower": "gradwatch/verdict", "upper": "gradwatch/verdict"} in margins
    # every tag the dashboard draws is one the server has data for
    assert layout_tags() <= set(server.get_json("/data/plugin/scalars/tags")[RUN])


@pytest.fixture(scope="module")
def chromium_binary() -> str:
    binary = find_chromium()
    if binary is None:
        message = "headless Chromium not found (apt-get install chromium)"
        if os.environ.get("GRADWATCH_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{message}, and GRADWATCH_REQUIRE_BROWSER=1 requires it")
        pytest.skip(message)
    return binary


def test_browser_shows_the_gradwatch_dashboard(server: TensorBoardServer, chromium_binary: str, tmp_path: Path) -> None:
    with HeadlessChromium(chromium_binary, width=1400, height=900) as browser:
        browser.open(f"{server.url}/#custom_scalars")
        # TensorBoard lists the tags each chart draws under it, as "<tag> (<run>)"; the Margin chart lists its value
        drawn = [REL_ERROR_TAGS[0], *(t for t in layout_tags() if t not in REL_ERROR_TAGS)]
        shown = browser.wait_for_text(
            [title for title, _ in SECTIONS]
            + [title for _, charts in SECTIONS for title, _, _ in charts]
            + [f"{tag} ({RUN})" for tag in drawn]
        )
        assert "No dashboards are active" not in shown
        screenshot = tmp_path / "dashboard.png"
        browser.screenshot(screenshot)
        assert png_size(screenshot) == (1400, 900)
        assert screenshot.stat().st_size > 30_000  # drawn charts, not a blank page

        browser.open(f"{server.url}/#text")
        browser.wait_for_text([FAILURES_TEXT_TAG, "failed at step 1", "net.fc.weight", "analytic", "numeric"])
