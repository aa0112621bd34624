"""How far a failing check's culprit search got: :class:`SearchProgress`, on the report
(:attr:`~gradwatch.engine.results.report.CheckReport.culprit_search`), and where a series of checks resumes it
(:mod:`gradwatch.engine.probing.search_budget`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SearchProgress:
    """How far a culprit search got.

    Attributes:
        complete: Whether the search ended by its own logic (a culprit named, or no module to single out); ``False``
            when its cap or its limit of probes stopped it.
        within: The modules proved to hold the bug, outermost first (where the next search resumes).
        candidates: The modules inside the deepest of them among which the bug still lies (its children the search was
            narrowing, in the order the forward runs them); all its children where it had not started narrowing.
        resumed: Whether the search resumed where an earlier check's stopped.
        evaluations: The loss evaluations the search spent in this check.
    """

    complete: bool
    within: tuple[str, ...] = ()
    candidates: tuple[str, ...] = ()
    resumed: bool = False
    evaluations: int = 0

    def resume_point(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(within, candidates)`` where the next search goes on: inside the deepest module proved, among the
        candidates left; after a complete search, inside the culprit it named (the next failing check proves it
        again and names it for a fraction of a whole search, or starts over where it no longer holds the bug)."""
        return (self.within, ()) if self.complete else (self.within, self.candidates)


__all__ = ["SearchProgress"]
