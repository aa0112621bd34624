"""What becomes of a watch's checks, of both kinds: :class:`Outcomes`.

Each report is kept (up to ``max_reports``), counted, written to every sink, handed to ``on_report`` and then to the
alerts (``on_fail``); what a run's reports say besides their verdicts is said once (:class:`~.alerts.Remarks`). A check
that raises is caught here, the one deliberate catch-all of the watch: a check never ends a training run (the engine
has already put the model back exactly), unless ``on_fail="raise"`` asks for it.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from gradwatch.engine import CheckReport
from gradwatch.engine.function.memory import is_out_of_memory, release_memory
from gradwatch.engine.results.notes import NoteCode
from gradwatch.engine.results.report import UnrestoredStateWarning
from gradwatch.outputs.records import Overhead, report_records
from gradwatch.outputs.sinks import Sink, write_to_sinks
from gradwatch.watch.alerts import AlertPolicy, Backoff, GradientCheckWarning, OnFail, Remarks
from gradwatch.watch.distributed import RaisedOnAnotherRankError, rank
from gradwatch.watch.guard import Guard
from gradwatch.watch.hooks import Agree, NoLossToCheckError

log = logging.getLogger(__name__)


class Outcomes:
    """The reports, counters, outputs and alerts of one run's checks (the arguments are the watch's, of the same
    names)."""

    def __init__(
        self,
        on_fail: OnFail,
        max_reports: int,
        verbose: bool,
        sinks: Sequence[Sink],
        on_report: Callable[[CheckReport], object] | None,
    ) -> None:
        self.on_fail, self.verbose = on_fail, verbose
        self.sinks = tuple(sinks)
        self.on_report = on_report
        self.reports: deque[CheckReport] = deque(maxlen=max_reports)
        self.alerts = AlertPolicy(on_fail, verbose=verbose)
        self.should_stop = False
        self.counts = {
            "checks": 0, "failed": 0, "skipped": 0, "applied_checks": 0, "applied_failed": 0, "update_checks": 0,
            "update_failed": 0,
        }  # fmt: skip
        """Recomputed checks run, failed and skipped (an error, no loss, a step the grad scaler skipped, no trainable
        parameter), applied and update checks run and failed."""
        self._remarks = {scope: Remarks(verbose=verbose) for scope in ("recomputed", "applied", "update")}
        self.guard = Guard()  # the watch's calls outside a check
        self._warned_unreached = False  # trainable parameters without a gradient: warned once per run, either kind

    def guarded(
        self, step: int, check: Callable[[], CheckReport], contexts: Sequence[contextlib.AbstractContextManager[Any]]
    ) -> CheckReport | None:
        """Run one check inside ``contexts``; ``None`` when it could not run (counted as skipped, reported by the
        alerts) instead of ending the run."""
        try:
            with contextlib.ExitStack() as stack, warnings.catch_warnings():
                for context in contexts:
                    stack.enter_context(context)
                # what a check could not put back is warned of once per run, by the remarks
                warnings.simplefilter("ignore", UnrestoredStateWarning)
                return check()
        except NoLossToCheckError:
            self.counts["skipped"] += 1
            log.debug("gradwatch: the loss_fn had no loss at step %d; check skipped", step)
        except Exception as error:
            if self.on_fail == "raise":
                self.guard.passes(error)  # through the guards of the calls around the check too
                raise
            self.counts["skipped"] += 1
            self.alerts.check_error(step, error)
            if is_out_of_memory(error):  # what the check held is freed before training's next step needs it
                release_memory(None, error)
        return None

    def agreed(
        self,
        step: int,
        check: Callable[[], CheckReport],
        contexts: Sequence[contextlib.AbstractContextManager[Any]],
        agree: Agree,
    ) -> CheckReport | None:
        """:meth:`guarded`, then under DDP the report every process acts on (``agree``); a raise on one process
        (``on_fail="raise"``) is made known to every process before any raises, or the others would wait."""
        try:
            report = self.guarded(step, check, contexts)
        except Exception as error:
            agree(None, error, step)
            raise
        try:
            return agree(report, None, step)
        except RaisedOnAnotherRankError as error:  # another process's on_fail="raise": it passes the guards too
            self.guard.passes(error)
            raise

    def publish(self, report: CheckReport, overhead: Overhead | float) -> None:
        """A report of either kind: kept, counted, remarked on, written to every sink, handed to ``on_report``, then
        to the alerts. Each part guarded on its own (:mod:`.guard`), so that a sink that raises cannot keep a failure
        from being counted and alerted; ``on_report`` is the user's, its errors theirs."""
        self.reports.append(report)
        prefix = "" if report.scope == "recomputed" else f"{report.scope}_"
        self.counts[prefix + "checks"] += 1
        self.counts[prefix + "failed"] += report.verdict == "fail"
        with self.guard("the remarks on a report"):
            self._remarks[report.scope].hear(report)
            log.debug("gradwatch %s", report.summary())
            unreached = report.noted(NoteCode.UNREACHED_PARAMETERS)
            if unreached and not self._warned_unreached:
                self._warned_unreached = True
                warnings.warn(f"gradwatch (step {report.step}): {unreached[0]}", GradientCheckWarning, stacklevel=3)
        records = None
        with self.guard("the records of a report"):
            records = report_records(report, overhead)
        for sink in self.sinks if records is not None else ():
            with self.guard(f"the sink {type(sink).__name__}"):  # one sink's error costs the others nothing
                write_to_sinks((sink,), records)
        if self.on_report is not None:
            self.guard.callers(self.on_report, report)
        # every process holds the same report (agreed, or an applied check the ranks made together): only rank 0
        # shows its warning; the backoff counts alike everywhere
        with self.guard("the alerts"):
            self.alerts.shown = rank() == 0
            if self.alerts.handle(report, self.guard.callers):
                self.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        return {**{key: self.counts[name] for name, key in _SAVED_COUNTS.items()},
                "failure_warnings": self.alerts.failures.count, "error_warnings": self.alerts.errors.count}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, key in {**_SAVED_COUNTS, "applied_checks": "applied_checks"}.items():
            self.counts[name] = int(state.get(key, 0))
        failures, errors = (Backoff(int(state.get(key, 0))) for key in ("failure_warnings", "error_warnings"))
        self.alerts = AlertPolicy(self.on_fail, failures, errors, verbose=self.verbose)


_SAVED_COUNTS = {
    "checks": "checks", "failed": "failed_checks", "skipped": "skipped_checks", "applied_failed": "applied_failed",
    "update_checks": "update_checks", "update_failed": "update_failed",
}  # fmt: skip
"""The counters a checkpoint's state carries, by its key (``applied_checks`` is the applied cadence's own key)."""
