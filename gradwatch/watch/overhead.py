"""gradwatch's own time against the training time, for the ``gradwatch/overhead*`` scalars and the budget
(:mod:`.cadence`).

The first recomputed and the first applied check (with its update check) are made whatever the budget, to measure what
a check costs: their time is kept apart (:attr:`OverheadClock.first_seconds`), so that the share the checks take from
then on (:attr:`OverheadClock.steady_fraction`, what the budget keeps near 1%) is not drowned by a one-time cost.
Training time is measured between the ends of consecutive training batches, minus the checks' time; time before the
first batch (set-up, a resumed run's restart) does not count.
"""

from __future__ import annotations

import math
from typing import Any

from gradwatch.outputs.records import Overhead


class OverheadClock:
    """Accumulates the time spent in checks and the time spent training."""

    def __init__(self) -> None:
        self.check_seconds = 0.0
        self.train_seconds = 0.0
        self.applied_seconds = 0.0
        self.first_seconds = 0.0
        """The time of the first recomputed check and of the first applied check: a one-time cost."""
        self._mark: float | None = None  # the end of the last training batch (or check)

    def restart(self) -> None:
        """Training (re)starts: the time until the next batch ends is not training time."""
        self._mark = None

    def batch_ended(self, now: float) -> None:  # the time since the last mark was training
        if self._mark is not None:
            self.train_seconds += now - self._mark
        self._mark = now

    @property
    def timing(self) -> bool:
        """Whether the time from now to the next batch's end is training time (a batch ended since training started)."""
        return self._mark is not None

    def check_ran(self, started: float, ended: float) -> None:
        if self.check_seconds == 0.0:
            self.first_seconds += ended - started
        self.check_seconds += ended - started
        self._mark = ended  # the check's own time is not training time

    def add_check(self, seconds: float, *, first: bool = False) -> None:
        """An applied check took ``seconds`` inside a training batch (at the optimizer step): its time is gradwatch's,
        not training's, and counts against the budget both kinds of check share. The first applied check's time is a
        one-time cost, and so is the update check it leads to (``first``)."""
        if first or self.applied_seconds == 0.0:
            self.first_seconds += seconds
        self.applied_seconds += seconds
        if self._mark is not None:
            self._mark += seconds

    @property
    def fraction(self) -> float:
        """gradwatch's time so far as a fraction of the training time."""
        spent = self.check_seconds + self.applied_seconds
        return spent / self.train_seconds if self.train_seconds > 0 else 0.0

    @property
    def steady_fraction(self) -> float:
        """gradwatch's time so far apart from the first checks (:attr:`first_seconds`), as a fraction of the training
        time (0 before any training time is measured)."""
        spent = self.check_seconds + self.applied_seconds - self.first_seconds
        return max(spent, 0.0) / self.train_seconds if self.train_seconds > 0 else 0.0

    def reading(self, steps: int) -> Overhead:
        """gradwatch's time so far against the training time, as the outputs show it (``steps``: the optimizer steps
        the training time covers, for the time of one)."""
        step = self.train_seconds / steps if steps and self.train_seconds > 0 else math.nan
        return Overhead(self.fraction, self.steady_fraction, self.first_seconds, step)

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _STATE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in _STATE:
            setattr(self, name, float(state.get(name, 0.0)))


_STATE = ("check_seconds", "train_seconds", "applied_seconds", "first_seconds")
"""The clock's state a checkpoint carries: its attributes, by name."""
