"""When a watch checks the gradient the optimizer applies, and the accumulation window it records for that check.

An applied check needs what the loop did before the optimizer step: every micro-batch of the window and the random
state each forward drew from. :class:`AppliedSchedule` decides, at the first micro-batch of a window, whether the
optimizer step the window leads to is due for an applied check and fits the budget; only then does the watch keep
the window (:class:`~gradwatch.engine.applied.AppliedWindow`: references to the batches, no copies). Every other
window costs one integer comparison per micro-batch.

Several optimizers (a GAN) each apply their own gradient, of their own loss: a loop records a window per optimizer
(``key``: the optimizer, so that each window replays the random state its own loss's forward drew from), or one window
the batch's optimizer steps share (Lightning's manual optimization, whose ``training_step`` is run again from the
batch's start), checked at each of them. A due step is one whose window crosses a multiple of the cadence: with two
optimizers, Lightning's windows lead to steps 1, 3, 5, ...

The budget is the one the recomputed checks spend (:class:`~gradwatch.watch.overhead.OverheadClock`, shared): the
first applied check is always made, as the first recomputed one (it measures what one costs); a later due check waits
until the training time affords what the last one cost. A postponed check is decided once (under DDP by rank 0 for
every rank, through the watch's ``decide``) and asked about again at the step computed to afford it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import nn

from gradwatch.engine.applied import AppliedWindow
from gradwatch.watch.overhead import OverheadClock


class AppliedSchedule:
    """The applied checks of one run: their cadence and budget, and the window being recorded.

    Args:
        every_n_steps: An applied check is due every this many optimizer steps (``None``: never).
        first_check_step: Another is due at this step (``None``: none).
        max_overhead: The share of the training time all checks may take (``None``: no budget).
        clock: gradwatch's time against the training's, shared with the recomputed checks.
    """

    def __init__(
        self, every_n_steps: int | None, first_check_step: int | None, max_overhead: float | None, clock: OverheadClock
    ) -> None:
        self.every_n_steps = every_n_steps
        self.first_check_step = first_check_step
        self.max_overhead = max_overhead
        self.clock = clock
        self.windows: dict[Any, AppliedWindow] = {}  # the windows being recorded, by key (None: shared)
        self._open = False  # whether the window step is due and affordable
        self._said_unrecorded = False
        self.faults: dict[int, tuple[int, str | None]] = {}  # by optimizer (id; None's id: all), the last check's fault
        # (step, GradientNorms, whether they are .grad's) of the last gradient a check verified
        self.verified: tuple[int, Any, bool] | None = None
        self.window_step = -1  # the optimizer step the current window leads to (recorded or not)
        self.checks = 0
        self.last_seconds = 0.0
        self._pending = False  # a due check postponed by the budget (or skipped by the grad scaler) runs later
        self._resume_at = 0  # a postponed check is not asked about again before this optimizer step
        self._steps_seen = 0  # windows this process trained (the training time per step: clock / steps)

    @property
    def enabled(self) -> bool:
        return self.every_n_steps is not None

    @property
    def window(self) -> AppliedWindow | None:
        """The shared window being recorded (or the first of those recorded per optimizer), else ``None``."""
        return next(iter(self.windows.values()), None)

    def due(self, step: int, previous: int | None = None) -> bool:
        """Whether optimizer step ``step`` (1 for the first) is due for an applied check: a multiple of the cadence in
        ``(previous, step]`` (``previous``: the last window's step, ``step - 1`` by default; a loop whose windows each
        lead to several optimizer steps numbers them apart) or the first check's step."""
        if self.every_n_steps is None:
            return False
        previous = step - 1 if previous is None or not 0 <= previous < step else previous
        every = self.every_n_steps
        return self._pending or step == self.first_check_step or step // every > previous // every

    def record(
        self, batch: Any, model: nn.Module | None, step: int, decide: Callable[[int], int], key: Any = None
    ) -> None:
        """A micro-batch of the window leading to optimizer step ``step`` is about to run its forward: keep it when that
        step is due and affordable (decided at the step's first micro-batch), in the window of ``key`` (an optimizer;
        ``None``: the window every optimizer of the step shares)."""
        if step != self.window_step:  # a new window begins
            self.windows = {}
            self._steps_seen += self.window_step >= 0
            previous, self.window_step = self.window_step, step
            self._open = self._opens(step, previous, decide)
        if self._open:
            window = self.windows.get(key)
            if window is None:
                window = self.windows[key] = AppliedWindow(model)
            window.record(batch)

    def take(self, step: int, key: Any = None) -> AppliedWindow | None:
        """The window recorded for optimizer step ``step`` (once: the watch checks it now), else ``None``. For an
        optimizer (``key``): its own window (once), or the one its batch's optimizer steps share (at each)."""
        if self.window_step != step:
            self.windows = {}
            return None
        if key is None or key in self.windows:
            return self.windows.pop(key, None)
        return self.windows.get(None)  # the shared window, for every optimizer step of its batch

    def abandon(self) -> None:
        """Recording this window failed (an error the watch's guard reported): no check of it, since a window kept
        in part would be checked against the wrong loss; the next window is decided afresh."""
        self.windows, self._open = {}, False

    def unrecorded(self, step: int) -> bool:
        """Whether optimizer step ``step`` is due while no micro-batch was recorded for it (a loop that does not call
        ``record``): ``True`` once per run, to be said."""
        if self._said_unrecorded or not self.enabled or self.window_step == step or not self.due(step):
            return False
        self._said_unrecorded = True
        return True

    def skipped(self) -> None:
        """The optimizer does not apply this step (a grad scaler found non-finite gradients): the check stays due."""
        self._pending = True

    def ran(self, seconds: float) -> None:
        """An applied check ran for ``seconds``, inside a training step: gradwatch's time, not training's."""
        self._pending = False
        self.checks += 1
        self.last_seconds = seconds
        self.clock.add_check(seconds)

    def _opens(self, step: int, previous: int, decide: Callable[[int], int]) -> bool:
        if not self.due(step, previous):
            return False
        if step < self._resume_at:
            self._pending = True
            return False
        wait = self._wait(decide)
        if wait:
            self._pending, self._resume_at = True, step + wait
            return False
        return True

    def _wait(self, decide: Callable[[int], int]) -> int:
        """0 when another applied check fits the budget, else the optimizer steps until the training time affords it
        at the mean time per step so far (the collective decision)."""
        budget = self.max_overhead
        if budget is None or not self.checks:  # the first check is made: it measures what one costs
            return 0
        clock = self.clock
        per_step = clock.train_seconds / self._steps_seen if self._steps_seen and clock.train_seconds > 0 else 0.0
        if per_step <= 0:
            wait = 1  # no training time measured yet: ask again at the next step
        else:
            needed = (clock.check_seconds + clock.applied_seconds + self.last_seconds) / budget - clock.train_seconds
            wait = max(0, math.ceil(needed / per_step))
        return int(decide(wait))

    def state_dict(self) -> dict[str, Any]:
        return {
            "applied_checks": self.checks,
            "applied_pending": self._pending,
            "applied_resume_at": self._resume_at,
            "applied_last_seconds": self.last_seconds,
            "applied_steps_seen": self._steps_seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.checks = int(state.get("applied_checks", 0))
        self._pending = bool(state.get("applied_pending", False))
        self._resume_at = int(state.get("applied_resume_at", 0))
        self.last_seconds = float(state.get("applied_last_seconds", 0.0))
        self._steps_seen = int(state.get("applied_steps_seen", 0))
