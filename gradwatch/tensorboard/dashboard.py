"""The gradwatch dashboard: a TensorBoard custom-scalars layout, written once per run.

TensorBoard's *Custom Scalars* tab shows the charts of a layout stored in the event files. gradwatch's three sections
hold one chart per question a reader has about a run:

* **verdict**: 0 ok, 1 inconclusive, 2 fail;
* **largest relative error, log10** (``gradwatch/rel_error_max_log10``), beside it: a wrong backward lifts it by
  orders of magnitude, even at checks where most probes agree. TensorBoard's charts have no logarithmic axis, and on a
  linear one a healthy run (1e-5 to 1e-3) is a flat line at 0 beside a failing run's 1e-1; in log10 they are apart;
* **relative error band, log10**: a Margin chart, the median relative error of the conclusive probes of each check
  inside a band from the smallest to the largest (tags ``gradwatch/rel_error_median_log10``,
  ``gradwatch/rel_error_min_log10``, ``gradwatch/rel_error_max_log10``);
* **descent ratio**: measured over predicted loss decrease along the gradient, 1 when the gradient is right;
* **probes failing / inconclusive**: counts per check;
* **check seconds**: the wall time of each check.

The layout names only fixed scalar tags (those of :meth:`gradwatch.engine.results.report.CheckReport.scalars` and their
log10
forms, which every logger receives), so it does not grow with the model. It is written through ``add_custom_scalars``
of a ``torch.utils.tensorboard.SummaryWriter``.
"""

from __future__ import annotations

import re
from typing import Protocol

LAYOUT_TAG = "custom_scalars__config__"
"""The tag under which TensorBoard stores a custom-scalars layout (fixed by TensorBoard)."""

REL_ERROR_TAGS = (
    "gradwatch/rel_error_median_log10",
    "gradwatch/rel_error_min_log10",
    "gradwatch/rel_error_max_log10",
)
"""The Margin chart's value, lower and upper tags, in the order TensorBoard expects them: the log10 of the relative
errors (``gradwatch/rel_error_median`` and so on, floored at -12), logged beside them."""

MAX_REL_ERROR_TAG = REL_ERROR_TAGS[2]
"""The log10 of the largest relative error of a check, charted on its own beside the verdicts."""

Chart = tuple[str, str, tuple[str, ...]]
"""A chart: title, TensorBoard chart kind (``"Margin"`` or ``"Multiline"``) and the scalar tags it draws."""

# The first section answers "is the gradient right, and how wrong is it": the verdicts beside the largest relative
# error of each check, which a wrong backward lifts by orders of magnitude even where most probes of its check agree.
# TensorBoard draws a section's Multiline charts before its Margin charts, so the band has a section of its own.
SECTIONS: tuple[tuple[str, tuple[Chart, ...]], ...] = (
    (
        "gradwatch: verdicts and relative error",
        (
            ("verdict (0 ok, 1 inconclusive, 2 fail)", "Multiline", ("gradwatch/verdict",)),
            ("log10 largest relative error of each check", "Multiline", (MAX_REL_ERROR_TAG,)),
        ),
    ),
    (
        "gradwatch: relative error band",
        (("log10 relative error of the checks (median, band from min to max)", "Margin", REL_ERROR_TAGS),),
    ),
    (
        "gradwatch: descent ratio, probes, cost",
        (
            ("descent ratio (1 = correct gradient)", "Multiline", ("gradwatch/descent_ratio",)),
            (
                "probes failing / inconclusive per check",
                "Multiline",
                ("gradwatch/failing_probes", "gradwatch/inconclusive_probes"),
            ),
            ("check seconds", "Multiline", ("gradwatch/check_seconds",)),
        ),
    ),
)
"""The sections of the Custom Scalars tab that gradwatch fills, in order, with their charts."""


def _exact(tag: str) -> str:
    # Multiline charts take regular expressions; anchor them so that a later tag sharing a prefix is not drawn too
    return f"^{re.escape(tag)}$"


def layout() -> dict[str, dict[str, list[object]]]:
    """The custom-scalars layout, in the format ``SummaryWriter.add_custom_scalars`` takes:
    ``{section: {chart title: ["Multiline", [tag regexes]] or ["Margin", [value, lower, upper]]}}``."""
    return {
        section: {
            title: [kind, list(tags) if kind == "Margin" else [_exact(tag) for tag in tags]]
            for title, kind, tags in charts
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
