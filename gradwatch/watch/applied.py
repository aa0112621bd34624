"""The accumulation windows a watch records for its applied checks, and what those checks leave for the next calls.

An applied check needs every micro-batch of the window and the random state each forward drew from. :class:`Windows`
decides at a window's first micro-batch whether the step it leads to is due and fits the budget (the applied
:class:`~.cadence.Cadence`); only then is the window kept (:class:`~gradwatch.engine.applied.AppliedWindow`:
references, no copies). Every other window costs one integer comparison per micro-batch.

With several optimizers (a GAN) a loop records a window per optimizer (``key``: each replays the random state its own
loss's forward drew from), or one window the batch's optimizer steps share (Lightning's manual optimization, whose
``training_step`` is run again from the batch's start). A due step is one whose window crosses a multiple of the
cadence: with two optimizers, Lightning's windows lead to steps 1, 3, 5, ...

With several optimizers on one loss (Muon and AdamW stepping in turn after one backward), the later optimizers'
windows ran their loss at the parameters before the earlier ones stepped: :meth:`Windows.stepping` keeps the values an
optimizer's parameters hold before its update while such windows are pending, and :meth:`Windows.earlier` gives them
to a later window's check (:mod:`.rewind`); a window recorded after a step (a GAN's generator) is checked at the
parameters as they are.

:class:`Findings` records what the applied checks found that later calls use: each optimizer's last fault (a change
found at two checks in a row is no one-off) and the norms of the gradient the last check verified (for the clip check).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gradwatch.engine.applied import AppliedWindow
from gradwatch.engine.applied.clipping import GradientNorms
from gradwatch.watch.cadence import Cadence
from gradwatch.watch.rewind import Earlier, before_update


class Windows:
    """The window being recorded for an applied check (or one per optimizer), on the applied ``cadence``."""

    def __init__(self, cadence: Cadence) -> None:
        self.cadence = cadence
        self.windows: dict[Any, AppliedWindow] = {}  # the windows being recorded, by key (None: shared)
        self.stepped: list[tuple[Any, dict[str, Any]]] = []  # the step's updates so far that windows are before
        self._since: dict[Any, int] = {}  # by key: how many of ``stepped`` came before its window was recorded
        self.step = -1  # the optimizer step the current window leads to (recorded or not)
        self._open = False  # whether the window's step is due and affordable
        self._until: float = 0  # no applied check is due after the window's step and before this one
        self._timed = False  # whether the clock times the current window (it began after a batch's end)
        self._said_unrecorded = False

    def due(self, step: int, previous: int | None = None) -> bool:
        """Whether optimizer step ``step`` (1 for the first) is due for an applied check, or one is pending (and not
        postponed past ``step``): a due step in ``(previous, step]`` (``previous``: the last window's step, ``step - 1``
        by default; a loop whose windows each lead to several optimizer steps numbers them apart)."""
        previous = step - 1 if previous is None or not 0 <= previous < step else previous
        waiting = self.cadence.pending and step >= self.cadence.resume_at  # not before a postponement ends
        return self.cadence.every_n_steps is not None and (waiting or self.cadence.due(previous, step))

    def begin(self, step: int, decide: Callable[[int], int]) -> bool:
        """A micro-batch of the window leading to optimizer step ``step`` is about to run its forward: whether it is
        kept (:meth:`record`), since that step is due and affordable (decided at the step's first micro-batch)."""
        if step != self.step:  # a new window begins
            if self.windows or self.stepped:
                self.windows, self.stepped = {}, []
            self.cadence.steps += self._timed  # the window before, if the clock timed it: the training time's steps
            self._timed = self.cadence.clock.timing
            previous, self.step = self.step, step
            if previous < step < self._until and not self.cadence.pending:
                self._open = False  # none due since the last window: the common case, known without a call
            else:
                self._open = self.due(step, previous) and self.cadence.runs_now(step, decide)
                self._until = self.cadence.next_due(step)
        return self._open

    def record(self, batch: Any, model: nn.Module | None, key: Any = None) -> None:
        """Keep the micro-batch in the window of ``key`` (an optimizer; ``None``: the step's shared window)."""
        window = self.windows.get(key)
        if window is None:
            window = self.windows[key] = AppliedWindow(model)
            self._since[key] = len(self.stepped)
        window.record(batch)

    def idle(self, step: int) -> bool:
        """Whether optimizer step ``step`` needs nothing of the windows at its optimizer step: its window was begun and
        not kept, and the step after it is not due either (whose update check keeps this step's gradient)."""
        if self.step != step or self._open:
            return False
        return (step + 1 < self._until and not self.cadence.pending) or not self.due(step + 1, step)

    def take(self, step: int, key: Any = None) -> AppliedWindow | None:
        """The window recorded for optimizer step ``step`` (once: the watch checks it now), else ``None``. For an
        optimizer (``key``): its own window (once), or the one its batch's optimizer steps share (at each)."""
        if self.step != step:
            self.windows, self.stepped = {}, []
            return None
        if key is None or key in self.windows:
            return self.windows.pop(key, None)
        return self.windows.get(None)  # the shared window, for every optimizer step of its batch

    def earlier(self, step: int, key: Any) -> Earlier:
        """The updates of optimizer step ``step`` taken since the window of optimizer ``key`` was recorded (its loss
        ran before them), in order; none for a shared window, whose losses may have run after them (a GAN's)."""
        if self.step != step or key is None or key not in self.windows:
            return []
        return self.stepped[self._since[key] :]

    def stepping(self, step: int, model: nn.Module, optimizer: Any) -> None:
        """``optimizer`` is about to update its parameters at step ``step``: while windows of other optimizers recorded
        before are still to be checked, keep their values before the update (see the module doc); else forget them."""
        if self.step == step and any(key is not None for key in self.windows):
            self.stepped.append((optimizer, before_update(model, optimizer)))
        else:
            self.stepped = []

    def abandon(self) -> None:
        """Recording this window failed (an error the watch's guard reported): no check of it, since a window kept
        in part would be checked against the wrong loss; the next window is decided afresh."""
        self.windows, self.stepped, self._open = {}, [], False

    def unrecorded(self, step: int) -> bool:
        """Whether optimizer step ``step`` is due while no micro-batch was recorded for it (a loop that does not call
        ``record``): ``True`` once per run, to be said."""
        if self._said_unrecorded or self.step == step or not self.due(step):
            return False
        self._said_unrecorded = True
        return True


@dataclass
class Verified:
    """The gradient an applied check verified at ``step``: its norms, and whether it is the model's ``.grad`` (else
    gradients an engine keeps elsewhere, which it clips itself)."""

    step: int
    norms: GradientNorms
    own: bool


@dataclass
class Findings:
    """What the applied checks found that later calls use (see the module doc)."""

    faults: dict[int, tuple[int, str | None]] = field(default_factory=dict)
    """By optimizer (``id``; ``id(None)``: every optimizer), the last check's step and fault."""
    verified: Verified | None = None
    """The gradient the last check verified, until the clip check of its step takes it."""

    def take_verified(self, step: int) -> Verified | None:
        """The gradient verified at ``step`` (forgotten now, whatever its step), else ``None``."""
        verified, self.verified = self.verified, None
        return verified if verified is not None and verified.step == step else None
