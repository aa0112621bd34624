"""When a watch's checks of one kind are due, and whether the budget affords one now: :class:`Cadence`, one class for
both kinds (the recomputed checks and the applied ones, with the update checks they lead to) on one clock.

A check is due at each multiple of ``every_n_steps`` and at the first check's step; a due check that does not run
(postponed by the budget, or its step skipped by the optimizer) stays pending until it runs.

The budget (``max_overhead``, a fraction of the training time on the shared
:class:`~gradwatch.watch.overhead.OverheadClock`) is one rule for both kinds: the first check of a kind always runs, to
measure what one costs; a later one runs while gradwatch's time so far, plus what the last check of its kind cost, stays
within it; else it is postponed by the optimizer steps the training needs to afford it at its mean time per step. The
postponement is decided once (under DDP by rank 0, through the watch's ``decide``) and asked again only at the step it
waits for.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from gradwatch.watch.overhead import OverheadClock

log = logging.getLogger(__name__)

RECOMPUTED_KEYS = {
    "last_step": "last_step", "pending": "pending", "postponed": "postponed_checks", "resume_at": "resume_at",
    "steps": "timed_steps", "cost": "last_check_seconds",
}  # fmt: skip
"""The recomputed cadence's state, by attribute: the keys of a watch's checkpoint state (kept from before)."""

APPLIED_KEYS = {
    "checks": "applied_checks", "pending": "applied_pending", "resume_at": "applied_resume_at",
    "cost": "applied_last_seconds", "steps": "applied_steps_seen",
}  # fmt: skip
"""The applied cadence's state, by attribute."""


class Cadence:
    """The cadence and budget of one ``kind`` of check over a run (``"recomputed"`` or ``"applied"``, as a
    postponement's log line names it), and what of it a checkpoint carries over (``keys``: :data:`RECOMPUTED_KEYS`,
    :data:`APPLIED_KEYS`). Checks are due every ``every_n_steps`` optimizer steps (``None``: never) and at
    ``first_check_step``, within ``max_overhead`` (``None``: no budget) of the training time on the ``clock`` both kinds
    share; ``verbose`` logs (INFO) the run's first postponement."""

    def __init__(
        self,
        kind: str,
        every_n_steps: int | None,
        first_check_step: int | None,
        max_overhead: float | None,
        clock: OverheadClock,
        *,
        keys: dict[str, str],
        verbose: bool = False,
    ) -> None:
        self.kind, self.every_n_steps, self.first_check_step = kind, every_n_steps, first_check_step
        self.max_overhead, self.clock, self.keys, self.verbose = max_overhead, clock, keys, verbose
        self.last_step = 0  # the step last considered, checked or not (the recomputed checks' calls keep it)
        self.pending = False  # a due check has not run yet (postponed, or its step skipped by the optimizer)
        self.postponed = 0
        self.resume_at = 0  # a postponed check is not asked about again before this step
        self.steps = 0  # optimizer steps the clock's training time covers, as this kind's calls count them
        self.cost = 0.0  # seconds the last check took (with the update check it led to): 0 until one is made
        self.checks = 0
        self._seen = -1  # the step of the last call: a later call at the same step (a micro-batch) is no new step
        self._timing = False  # whether the steps since training (re)started are timed yet
        self._quiet: tuple[float, float] = (0, 0)  # no check is due at the steps strictly between these two

    @property
    def enabled(self) -> bool:
        return self.every_n_steps is not None

    def due(self, previous: int, step: int) -> bool:
        """Whether a check is due among the optimizer steps ``previous < s <= step`` (pending ones aside)."""
        return step >= self.next_due(previous)

    def next_due(self, previous: int) -> float:
        """The first optimizer step after ``previous`` at which a check is due (pending ones aside; infinity: none
        ever): no step before it needs this kind's attention, which the calls of every step compare with once."""
        if self.every_n_steps is None:
            return math.inf
        following = (previous // self.every_n_steps + 1) * self.every_n_steps
        first = self.first_check_step
        return first if first is not None and previous < first < following else following

    def start(self, step: int) -> None:
        """Training (re)starts at ``step``: the steps until the next call are not timed."""
        self._timing, self._seen = False, step

    def reached(self, step: int) -> bool:
        """A call at optimizer step ``step``, the first of that step or a later micro-batch's: whether a check is due
        (at the step's first call; it stays due, pending, until it runs) and not waiting for a postponement (a step
        the grad scaler skips during one is then no skipped check)."""
        if step == self._seen:
            return False
        if self._timing:
            self.steps += step - self._seen
        self._timing, self._seen = True, step
        if not self.pending:
            base, until = self._quiet
            if not base <= self.last_step < step < until:  # else none due in between, as known since the last one
                self._quiet = (self.last_step, self.next_due(self.last_step))
                self.pending = step >= self._quiet[1]
        if not self.pending or self.postponed_past(step):  # a postponed check is not asked about before resume_at
            self.last_step = step
            return False
        return True

    def postponed_past(self, step: int) -> bool:
        """Whether the check due waits, at ``step``, for the postponement the budget decided (``resume_at``)."""
        return self.max_overhead is not None and step < self.resume_at

    def runs_now(self, step: int, decide: Callable[[int], int]) -> bool:
        """Whether the check due at ``step`` runs now (it is then no longer pending), or is postponed to fit the budget
        (it stays pending).

        ``decide`` turns this process's proposal (0 to check now, else the steps to wait) into the decision every
        process takes (a broadcast from rank 0 under DDP, the identity otherwise). It is called only at a due step with
        a budget, and not while a postponement lasts."""
        self.last_step = step
        if self.max_overhead is not None:
            if self.postponed_past(step):
                self.pending = True
                return False
            wait = int(decide(self._wait(self.max_overhead)))
            if wait > 0:
                if not self.postponed and self.verbose:
                    log.info(
                        "gradwatch: the %s check due at step %d is postponed by %d steps, so that checks cost at "
                        "most %g of the training time (max_overhead); max_overhead=None checks on schedule",
                        self.kind, step, wait, self.max_overhead,
                    )  # fmt: skip
                self.pending, self.resume_at = True, step + wait
                self.postponed += 1
                return False
        self.pending = False
        return True

    def _wait(self, budget: float) -> int:
        """0 when another check, at what the last one cost, fits the budget (or none was made yet: the first measures
        the cost), else the optimizer steps until the training time affords it at the mean time per step so far (at
        least 1)."""
        clock = self.clock
        needed = (clock.check_seconds + clock.applied_seconds + self.cost) / budget - clock.train_seconds
        if self.cost == 0.0 or needed <= 0:
            return 0
        per_step = clock.train_seconds / self.steps if self.steps > 0 and clock.train_seconds > 0 else 0.0
        return max(1, math.ceil(needed / per_step)) if per_step > 0 else 1

    @property
    def unbounded(self) -> bool:
        """Whether the next check is one no budget bounds: the first of its kind, made whatever the budget to measure
        what one costs (an applied one leaves its closer look to later: :mod:`gradwatch.engine.applied.probes`)."""
        return self.checks == 0 and self.max_overhead is not None

    def owe(self) -> None:
        """A check stays due (pending, and in a checkpoint's state as such), made when the budget affords it: the
        optimizer does not apply its step (a grad scaler found non-finite gradients), or the check just made left part
        of its work for later (the first applied check's closer look)."""
        self.pending = True

    def ran(self, seconds: float) -> None:
        """A check of this kind ran (or was attempted) for ``seconds``: what the next one is expected to cost."""
        self.checks += 1
        self.cost = seconds

    def state_dict(self) -> dict[str, Any]:
        return {key: getattr(self, name) for name, key in self.keys.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, key in self.keys.items():
            default = _DEFAULTS[name]
            setattr(self, name, type(default)(state.get(key, default)))


_DEFAULTS: dict[str, Any] = {"last_step": 0, "pending": False, "postponed": 0, "resume_at": 0, "steps": 0, "cost": 0.0,
                             "checks": 0}  # fmt: skip
"""A fresh cadence's state: what a key missing from an older checkpoint's state takes."""
