"""The options of a :class:`~gradwatch.watch.watch.GradientWatch` that the adapters over it pass on as they are, and
the reports they read back from it (:class:`WatchedReports`).

``GradWatch`` and ``GradWatchCallback`` take them as ``**options: Unpack[WatchOptions]`` and hand them to the watch,
which validates them, holds their defaults and documents them; the adapters declare only what they use or lend
themselves.
"""

from __future__ import annotations

from typing import Literal, Protocol

from gradwatch.engine import CheckReport, LossFn
from gradwatch.engine.settings import ProbeOptions
from gradwatch.watch.alerts import OnFail
from gradwatch.watch.watch import GradientWatch


class WatchOptions(ProbeOptions, total=False):
    """The keyword arguments of :class:`~gradwatch.GradientWatch` an adapter passes on, documented there, and the probe
    options (:class:`~gradwatch.engine.settings.ProbeOptions`: the fields of
    :class:`~gradwatch.engine.settings.ProbeSettings`)."""

    every_n_steps: int | None
    first_check_step: int | None
    applied_every_n_steps: int | None
    on_fail: OnFail
    loss_fn: LossFn | None
    max_overhead: float | Literal["auto"] | None
    max_reports: int
    verbose: bool
    check_update: bool
    max_culprit_search_steps: int | None


WATCH_OPTIONS = frozenset(WatchOptions.__optional_keys__) - frozenset(ProbeOptions.__optional_keys__)
"""The watch's own options among them (what an adapter reads back from its watch by name)."""


class _Watching(Protocol):
    @property
    def watch(self) -> GradientWatch: ...


class WatchedReports:
    """The reports and counters of the watch an adapter drives (its ``watch``), read through the adapter."""

    @property
    def reports(self: _Watching) -> list[CheckReport]:
        """The reports of this run's checks of every kind, oldest first (at most ``max_reports``)."""
        return self.watch.reports

    @property
    def recomputed_reports(self: _Watching) -> list[CheckReport]:
        """The reports of this run's recomputed checks (``scope == "recomputed"``), oldest first."""
        return self.watch.recomputed_reports

    @property
    def applied_reports(self: _Watching) -> list[CheckReport]:
        """The reports of this run's applied checks and clip coefficient checks (``scope == "applied"``), oldest
        first."""
        return self.watch.applied_reports

    @property
    def update_reports(self: _Watching) -> list[CheckReport]:
        """The reports of this run's update checks (the update the optimizer made of a verified gradient; ``scope ==
        "update"``), oldest first."""
        return self.watch.update_reports

    @property
    def counts(self: _Watching) -> dict[str, int]:
        """See :attr:`gradwatch.GradientWatch.counts` (continued from the checkpoint on resume)."""
        return self.watch.counts
