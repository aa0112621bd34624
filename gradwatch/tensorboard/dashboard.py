"""The gradwatch dashboard: a TensorBoard custom-scalars layout, written once per run.

TensorBoard's *Custom Scalars* tab shows the charts of a layout stored in the event files. gradwatch's sections
(:data:`SECTIONS`) hold one chart per question a reader has about a run: the verdicts of both kinds of check, the
relative errors in log10 (TensorBoard's charts have no logarithmic axis, and on a linear one a healthy run's 1e-5 to
1e-3 is a flat line at 0 beside a failing run's 1e-1), the descent ratios and probe counts, the cost, and the update
checks (:func:`gradwatch.outputs.records.update_scalars`). Every chart is a Margin chart (see :func:`_points`). The
layout names only fixed scalar tags (those of :meth:`gradwatch.engine.results.report.CheckReport.scalars`, their log10
forms, the applied checks', the update checks' and the overhead's, which every logger receives), so it does not grow
with the model.
"""

from __future__ import annotations

import re
from typing import Protocol

from gradwatch.tensorboard.writer import UPDATE_PREFIX

LAYOUT_TAG = "custom_scalars__config__"
"""The tag under which TensorBoard stores a custom-scalars layout (fixed by TensorBoard)."""

REL_ERROR_TAGS = ("gradwatch/rel_error_median_log10", "gradwatch/rel_error_min_log10", "gradwatch/rel_error_max_log10")
"""The Margin chart's value, lower and upper tags, in the order TensorBoard expects them: the log10 of the relative
errors (``gradwatch/rel_error_median`` and so on, floored at -12), logged beside them."""

MAX_REL_ERROR_TAG = REL_ERROR_TAGS[2]
"""The log10 of the largest relative error of a check, charted on its own beside the verdicts."""

Chart = tuple[str, str, tuple[str, ...]]
"""A chart: title, TensorBoard chart kind (``"Margin"`` or ``"Multiline"``) and the scalar tags it draws."""


def _points(title: str, tag: str) -> Chart:
    """A chart of one tag that shows every point, a lone one too: a Margin chart whose band is the value itself.
    TensorBoard scales a line chart without its outliers by default, and with one point per run (a run at gradwatch's
    defaults checks at step 1, then every 500 steps within a 1% budget) the points are the outliers: a Multiline chart
    of two runs' single checks was drawn empty, the Margin chart of the same points shows both."""
    return (title, "Margin", (tag, tag, tag))


# The first sections answer "is the gradient right, and how wrong is it": a wrong backward lifts the largest relative
# error by orders of magnitude even where most probes of its check agree. The order below is the order shown.
SECTIONS: tuple[tuple[str, tuple[Chart, ...]], ...] = (
    (
        "gradwatch: verdicts (0 ok, 1 inconclusive, 2 fail)",
        (
            _points("verdict of the recomputed checks (the formulas)", "gradwatch/verdict"),
            _points("verdict of the applied checks (the gradient the optimizer applies)", "gradwatch/applied/verdict"),
        ),
    ),
    (
        "gradwatch: relative error, log10",
        (
            ("median relative error of each check, in a band from min to max", "Margin", REL_ERROR_TAGS),
            _points("largest relative error of each check", MAX_REL_ERROR_TAG),
        ),
    ),
    (
        "gradwatch: descent ratio and probes",
        (
            _points("descent ratio of the recomputed checks (1 = correct gradient)", "gradwatch/descent_ratio"),
            _points("descent ratio of the applied checks (1 = correct gradient)", "gradwatch/applied/descent_ratio"),
            _points("failing probes per check", "gradwatch/failing_probes"),
            _points("inconclusive probes per check", "gradwatch/inconclusive_probes"),
        ),
    ),
    (
        "gradwatch: cost",
        (
            _points("overhead, % of the training time after the first checks", "gradwatch/overhead_percent"),
            _points("first checks: one-time cost, seconds", "gradwatch/first_checks_seconds"),
            _points("seconds per recomputed check", "gradwatch/check_seconds"),
            _points("seconds per applied check", "gradwatch/applied/check_seconds"),
        ),
    ),
    (
        "gradwatch: update checks (the optimizer's update against a reference)",
        (
            _points("verdict of the update checks (0 ok, 1 inconclusive, 2 fail)", UPDATE_PREFIX + "verdict"),
            _points("fault of the update checks (0 none, else its code)", UPDATE_PREFIX + "fault"),
            _points("largest relative error of an update against its reference", UPDATE_PREFIX + "rel_error_max"),
            _points("floor: the optimizer's own rounding, relative to the reference", UPDATE_PREFIX + "noise_floor"),
            _points("largest discrepancy over its tolerance (1 = at the tolerance)", UPDATE_PREFIX + "floor_excess"),
            _points("seconds per update check", UPDATE_PREFIX + "check_seconds"),
        ),
    ),
)
"""The sections of the Custom Scalars tab that gradwatch fills, in order, with their charts."""


def _exact(tag: str) -> str:
    # Multiline charts take regular expressions; anchor them so that a later tag sharing a prefix is not drawn too
    return f"^{re.escape(tag)}$"


def layout() -> dict[str, dict[str, list[object]]]:
    """The custom-scalars layout, in the format ``SummaryWriter.add_custom_scalars`` takes:
    ``{section: {chart title: ["Multiline", [tag regexes]] or ["Margin", [value, lower, upper]]}}``; each section's
    charts in the reverse of :data:`SECTIONS`' order, because TensorBoard draws a section's Margin charts last first
    (seen in headless Chromium), so that they are shown in that order."""
    return {
        section: {
            title: [kind, list(tags) if kind == "Margin" else [_exact(tag) for tag in tags]]
            for title, kind, tags in reversed(charts)
        }
        for section, charts in SECTIONS
    }


def layout_tags() -> set[str]:
    """Every scalar tag the dashboard draws."""
    return {tag for _, charts in SECTIONS for _, _, tags in charts for tag in tags}


class CustomScalarsWriter(Protocol):
    def add_custom_scalars(self, layout: dict[str, dict[str, list[object]]]) -> object: ...


def write_dashboard(writer: CustomScalarsWriter) -> None:
    """Write gradwatch's custom-scalars layout to ``writer`` (call once per writer: TensorBoard keeps one layout per
    run, and a second one would only repeat it)."""
    writer.add_custom_scalars(layout())
