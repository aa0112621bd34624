"""The options of a :class:`~gradwatch.watch.watch.GradientWatch` that the adapters over it pass on as they are.

``GradWatch`` and ``GradWatchCallback`` take them as ``**options: Unpack[WatchOptions]`` and hand them to the watch,
which validates them, holds their defaults and documents them; the adapters declare only what they use or lend
themselves. The probe options are among them (:class:`~gradwatch.engine.settings.ProbeOptions`, the fields of
:class:`~gradwatch.engine.settings.ProbeSettings`).
"""

from __future__ import annotations

from typing import Literal

from gradwatch.engine import LossFn
from gradwatch.engine.settings import ProbeOptions
from gradwatch.watch.alerts import OnFail


class WatchOptions(ProbeOptions, total=False):
    """The keyword arguments of :class:`~gradwatch.GradientWatch` an adapter passes on: documented there, with their
    defaults, and the probe options."""

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
