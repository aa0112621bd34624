"""What a watch runs outside a check never ends a run either: :class:`Guard`.

A check is guarded where it runs (:meth:`Outcomes.guarded <gradwatch.watch.outcomes.Outcomes.guarded>`). The watch's
and its adapters' own bookkeeping around it (a window's checksums, the clip check's norms, the schedule, the checkpoint
state, the sinks, the lessons, the alerts, the loop's hooks) runs inside ``guard(site)``: an error there (out of memory
included) becomes one note (:attr:`Guard.notes`, code ``watch-error``) and one :class:`~gradwatch.GradientCheckWarning`,
once per site and run (and once for the same error at two sites), and training goes on exactly as without gradwatch
(these calls read training's tensors, never write them).

What passes every guard: :class:`~gradwatch.GradientCheckError` (``on_fail="raise"``), what is no ``Exception``
(``KeyboardInterrupt``, ``SystemExit``), and the caller's errors: bad arguments and the user's own code (``loss_fn``,
``on_report``, an ``on_fail`` callable) run through :meth:`Guard.callers`, and what a check's own guard lets through,
marked by :meth:`Guard.passes`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from gradwatch.engine.function.memory import is_out_of_memory, release_memory
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import GradientCheckError
from gradwatch.watch.alerts import GradientCheckWarning, log_traceback

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


class Guard:
    """The guard of one run's calls outside a check (see the module doc).

    Example:
        >>> import warnings
        >>> guard = Guard()
        >>> with warnings.catch_warnings(record=True), guard("record"):
        ...     raise RuntimeError("out of memory")
        >>> [note.code.value for note in guard.notes]
        ['watch-error']
    """

    def __init__(self) -> None:
        self.notes: list[Note] = []
        """One note per site whose call raised, the first error there (in the order they happened)."""
        self._sites: set[str] = set()
        self._errors: set[str] = set()
        self._passing: BaseException | None = None  # the last error that is the caller's, let through every guard
        self._blocks: dict[str, _Guarded] = {}  # by site: a guarded block holds no state of its own, made once

    def __call__(self, site: str) -> contextlib.AbstractContextManager[None]:
        """Run the block; an ``Exception`` it raises that is not the caller's is reported (once for ``site``) and the
        block is left, as if it had returned."""
        block = self._blocks.get(site)
        if block is None:
            block = self._blocks[site] = _Guarded(self, site)
        return block

    def passes(self, error: BaseException) -> BaseException:
        """Mark ``error`` as the caller's: it passes every guard it meets (returned, for ``raise guard.passes(e)``)."""
        self._passing = error
        return error

    def callers(self, call: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``call(*args, **kwargs)``, whose errors are the caller's (argument validation, the user's own callables):
        they pass every guard."""
        try:
            return call(*args, **kwargs)
        except Exception as error:
            self.passes(error)
            raise

    def absorbs(self, site: str, error: BaseException) -> bool:
        """Whether the guard of ``site`` takes ``error`` (reported, see :meth:`report`) rather than let it through: an
        ``Exception`` that is neither the caller's nor a failing check's. What ``with guard(site)`` does, for the calls
        of every training step, which use ``try``/``except`` instead (free in Python 3.11 when nothing is raised)."""
        if not isinstance(error, Exception) or isinstance(error, GradientCheckError) or error is self._passing:
            return False
        self.report(site, error)
        return True

    def report(self, site: str, error: Exception) -> None:
        """``error`` in ``site``: a note and a warning the first time ``site`` raised in this run; a debug log."""
        message = (
            f"gradwatch: {site} raised {type(error).__name__}: {error}; gradwatch skipped it and training goes on "
            "unaffected (said once for this call)"
        )
        log_traceback(message, error)
        if is_out_of_memory(error):  # what the call held is freed before training's next step needs it
            release_memory(None, error)
        said = f"{type(error).__name__}: {error}"  # the same error from a function that two sites call: said once
        if site in self._sites or said in self._errors:
            return
        self._sites.add(site)
        self._errors.add(said)
        self.notes.append(Note(NoteCode.WATCH_ERROR, message))
        warnings.warn(message, GradientCheckWarning, stacklevel=3)  # the code of the guarded block


class _Guarded:
    """One guarded block of :class:`Guard`: a plain context manager, not a generator's, since a watch enters several
    on every training step (a few hundred nanoseconds each instead of microseconds)."""

    __slots__ = ("_guard", "_site")

    def __init__(self, guard: Guard, site: str) -> None:
        self._guard, self._site = guard, site

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: Any) -> bool:
        return error is not None and self._guard.absorbs(self._site, error)


def guarded_hook(site: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A loop's hook method (of an adapter whose ``watch`` is the watch it drives) run inside ``watch.guarded(site)``:
    what the adapter does there never ends the run. For hooks that return nothing."""

    def decorate(hook: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(hook)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                hook(self, *args, **kwargs)
            except Exception as error:
                if not self.watch.absorbs(site, error):
                    raise

        return guarded

    return decorate
