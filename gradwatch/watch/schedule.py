"""When checks run: the cadence, the first check, and the budget that postpones a check gradwatch cannot afford.

Free of Lightning: the callback tells the schedule which optimizer step a training batch ended at and asks whether a
check runs now. Steps are optimizer steps (``trainer.global_step``): the micro-batches of gradient accumulation end
at the same step and are seen once.

The budget (``max_overhead``) keeps gradwatch's time within a fraction of the training time, as the
:class:`~gradwatch.watch.overhead.OverheadClock` measures them. A due check that does not fit is postponed by as
many steps as the training time it still needs: one decision (the caller makes it collective under DDP, rank 0
deciding for all), and no work at all on the steps in between.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from gradwatch.outputs.records import Overhead
from gradwatch.watch.overhead import OverheadClock

log = logging.getLogger(__name__)


class Schedule:
    """The check schedule of one run, and what of it a checkpoint carries over.

    Args:
        every_n_steps: A check is due every this many optimizer steps.
        first_check_step: Another check is due at this step (``None``: none).
        max_overhead: The budget, a fraction of the training time (``None``: no budget).
        verbose: Log (INFO) the first postponement of a run.
    """

    def __init__(
        self, every_n_steps: int, first_check_step: int | None, max_overhead: float | None, *, verbose: bool = False
    ) -> None:
        self.every_n_steps = every_n_steps
        self.verbose = verbose
        self.first_check_step = first_check_step
        self.max_overhead = max_overhead
        self.clock = OverheadClock()
        self.last_step = 0  # the step the schedule last looked at, checked or not
        self.pending = False  # a check is due and has not run yet (skipped by the grad scaler, or postponed)
        self.postponed = 0
        self._seen_step = -1  # global_step at the last batch end: unchanged after a micro-batch of accumulation
        self._resume_at = 0  # a postponed check waits until this step
        self._timed_steps = 0  # optimizer steps the clock's training time covers
        self._timing = False  # whether the clock has started timing since training (re)started

    def due(self, previous_step: int, step: int) -> bool:
        """Whether a check is due after the optimizer steps ``previous_step < s <= step``."""
        if self.first_check_step is not None and previous_step < self.first_check_step <= step:
            return True
        return step // self.every_n_steps > previous_step // self.every_n_steps

    def due_next(self, step: int) -> bool:
        """Whether a check is (or stays) due at the optimizer step after ``step``."""
        return self.pending or self.due(self.last_step, step + 1)

    def start(self, step: int) -> None:
        """Training (re)starts at ``step`` (restored from a checkpoint when resuming)."""
        self.clock.restart()  # time before the first batch (set-up, a resumed run's restart) is not training time
        self._timing = False
        self._seen_step = step

    def step_ended(self, step: int, now: float) -> bool:
        """A training batch ended at optimizer step ``step`` at time ``now``: whether a check is due now (the first
        time the step is seen; a check stays due until :meth:`ran`)."""
        self.clock.batch_ended(now)
        if step == self._seen_step:
            return False
        if self._timing:
            self._timed_steps += step - self._seen_step
        self._timing = True
        self._seen_step = step
        self.pending = self.pending or self.due(self.last_step, step)
        if not self.pending:
            self.last_step = step
        return self.pending

    def runs_now(self, step: int, decide: Callable[[int], int]) -> bool:
        """Whether the check due at ``step`` runs now (it is then no longer pending), or is postponed to fit the
        budget.

        ``decide`` turns this process's proposal (0 to check now, else the steps to wait) into the decision every
        process takes (a broadcast from rank 0 under DDP, the identity otherwise). It is called only at a due step
        with a budget, and not while a postponement lasts.
        """
        self.last_step = step
        if self.max_overhead is not None:
            if step < self._resume_at:
                return False
            wait = 0
            if not self.clock.affordable(self.max_overhead):
                wait = self.clock.steps_until_affordable(self.max_overhead, self._timed_steps)
            wait = int(decide(wait))
            if wait > 0 and not self.postponed and self.verbose:
                log.info(
                    "gradwatch: the check due at step %d is postponed by %d steps, so that checks cost at most %g of "
                    "the training time (max_overhead); max_overhead=None checks on schedule",
                    step, wait, self.max_overhead,
                )  # fmt: skip
            if wait > 0:
                self._resume_at = step + wait
                self.postponed += 1
                return False
        self.pending = False
        return True

    @property
    def resume_at(self) -> int:
        """The step a postponed check waits for."""
        return self._resume_at

    def overhead(self) -> Overhead:
        """gradwatch's time so far against the training time, as the outputs show it."""
        clock = self.clock
        step = clock.train_seconds / self._timed_steps if self._timed_steps and clock.train_seconds > 0 else math.nan
        return Overhead(clock.fraction, clock.steady_fraction, clock.first_seconds, step)

    def ran(self, started: float, ended: float) -> None:
        """The check ran (or was attempted) from ``started`` to ``ended``."""
        self.clock.check_ran(started, ended)

    def state_dict(self) -> dict[str, Any]:
        return {
            "last_step": self.last_step,
            "pending": self.pending,
            "postponed_checks": self.postponed,
            "resume_at": self._resume_at,
            "timed_steps": self._timed_steps,
            **self.clock.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = int(state.get("last_step", 0))
        self.pending = bool(state.get("pending", False))
        self.postponed = int(state.get("postponed_checks", 0))
        self._resume_at = int(state.get("resume_at", 0))
        self._timed_steps = int(state.get("timed_steps", 0))
        self.clock.load_state_dict(state)
