"""What a failing check's culprit search may spend, and where it starts: :class:`SearchBudget`.

A search costs loss evaluations in proportion to the depth and breadth of the model's call tree; on a large model
evaluated point by point it ran for minutes while training waited. A series of checks
(:class:`~gradwatch.GradientWatch`) therefore caps each failing check's search, in training steps of the run: when it
runs out, the verdict stands, the report names the deepest module proved to hold the bug and the candidates left inside
it (:class:`~gradwatch.engine.results.report.SearchProgress`), and the next failing check resumes there
(``within``, ``candidates``): it proves the module still holds the bug and goes on from the candidates left, so that a
bug is localised over a few bounded checks. After a complete search the next failing check resumes inside the culprit it
named, which it proves again for a fraction of a whole search.

The cap stops a search only once it narrowed the culprit further than where it started (a module more, or fewer
candidates), so that a search spread over checks ends even where one step of it costs more than the cap. A one-shot
:func:`~gradwatch.check_gradients` searches to the end (the search's own limits,
:mod:`gradwatch.engine.culprits.activations`) unless given a budget. The clock is injected (``clock``), so that a test
spends a budget by counting, never by wall time.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from gradwatch.engine.distributed import tensor_parallel
from gradwatch.engine.distributed.collective import any_rank


@dataclasses.dataclass
class SearchBudget:
    """What a culprit search may spend in one check, and where it starts.

    Args:
        steps: The cap, in training steps (``None``: none beyond the search's own limits).
        step_seconds: The time of one training step, by the caller's clock (a watch's mean step); ``None`` or not
            finite: the check's own reference pass stands in for it (:meth:`stand_in`): an applied check's forward
            and backward of the whole window, a recomputed check's of its probe batch scaled to the whole batch.
        within: The modules an earlier search proved to hold the bug, outermost first: the search resumes inside the
            deepest of them if it still holds the bug, else starts from the loss.
        candidates: Where the bug lies among that module's children, as the earlier search left them.
        clock: Seconds, monotonic (``time.perf_counter`` by default; a test counts instead).
        min_seconds: The cap never stops a search sooner than this: where training steps take milliseconds (a small
            model), a search of a second or two stalls nothing, and its culprit is named at the first failing check.

    Raises:
        ValueError: ``steps`` is not a positive number, or ``step_seconds`` is negative.
    """

    steps: float | None = None
    step_seconds: float | None = None
    within: tuple[str, ...] = ()
    candidates: tuple[str, ...] = ()
    clock: Callable[[], float] = time.perf_counter
    min_seconds: float = 0.0
    _started: float | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.steps is not None and (isinstance(self.steps, bool) or not self.steps > 0):
            raise ValueError(f"`steps` of a SearchBudget must be None or a positive number of training steps; got "
                             f"{self.steps!r}")  # fmt: skip
        if self.step_seconds is not None and not self.step_seconds >= 0:
            raise ValueError(f"`step_seconds` must be None or >= 0; got {self.step_seconds!r}")
        self.within, self.candidates = tuple(self.within), tuple(self.candidates)

    def start(self) -> None:
        """The search's spending starts now; later calls change nothing (an applied check's search starts before the
        recomputed check it runs, a 16-bit model's search spends on its float32 twin too)."""
        if self._started is None:
            self._started = self.clock()

    def stand_in(self, reference_seconds: float) -> None:
        """A check's reference pass stands in for a training step where the caller gave no step time."""
        if self.step_seconds is None or not math.isfinite(self.step_seconds):
            self.step_seconds = reference_seconds

    @property
    def seconds(self) -> float:
        """The time the search may take (infinite without a cap or a known step time)."""
        step = self.step_seconds
        if self.steps is None or step is None or not math.isfinite(step):
            return math.inf
        return max(self.steps * step, self.min_seconds)

    def exhausted(self) -> bool:
        """Whether the search has spent its cap since :meth:`start`, on this rank or on any rank searching in
        lockstep with it (a sharded or tensor-parallel check, a global check of a loss with collectives): each rank
        reads its own clock, and ranks that stopped at different points would run different collectives."""
        spent = self._started is not None and not math.isinf(self.seconds)
        spent = spent and self.clock() - self._started >= self.seconds  # type: ignore[operator]
        return tensor_parallel.any_replica(any_rank([spent])[0])


__all__ = ["SearchBudget"]
