"""What happens when a check fails: a warning, an exception, a stop request or a user callback.

Warnings are rate-limited with exponential backoff: the 1st, 2nd, 4th, 8th, ... failing check warns, so a bug present
from step 1 of a week-long run produces a few dozen warnings rather than thousands (every report stays in the watch's
``reports``). The failing checks whose warning the backoff withholds get a log record (INFO, unless ``verbose=False``).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from typing import Literal

from gradwatch.engine.results.diagnosis import diagnose
from gradwatch.engine.results.notes import NoteCode
from gradwatch.engine.results.rendering import nonfinite_loss, nonfinite_loss_words, render_text
from gradwatch.engine.results.report import CheckReport, GradientCheckError
from gradwatch.errors import GradientCheckWarning, own_error

log = logging.getLogger(__name__)

OnFail = Literal["warn", "raise", "stop"] | Callable[[CheckReport], object]
ON_FAIL_CHOICES = ("warn", "raise", "stop")


def log_traceback(message: str, error: BaseException) -> None:
    """The traceback of an error a check or the watch skipped: at DEBUG for whoever debugs gradwatch, at ERROR when it
    is a bug of gradwatch's own (:func:`~gradwatch.errors.own_error`), so that it is seen and reported."""
    if own_error(error):
        log.error("%s; this is a bug of gradwatch's own: please report it with this traceback", message, exc_info=error)
    else:
        log.debug(message, exc_info=error)


class Backoff:
    """Lets through events number 1, 2, 4, 8, ... of a series; the rest are counted."""

    def __init__(self, count: int = 0) -> None:
        self.count = count

    def admit(self) -> bool:
        """Count one event; whether it should be reported."""
        self.count += 1
        return self.count & (self.count - 1) == 0

    @property
    def next_reported(self) -> int:
        """The number of the next event that will be reported."""
        return 1 << self.count.bit_length()


class AlertPolicy:
    """Applies ``on_fail`` (the watch's) to failing reports, with the backoffs of the failure warnings (``failures``,
    restored from a checkpoint) and of the warnings for checks that could not run (``errors``). ``verbose``: a failure
    or an error whose warning the backoff withholds gets a log record (INFO). ``shown``: whether this process shows
    failure warnings (where every process holds the same report, DDP or FSDP2, only rank 0 shows it, as Lightning's own
    warnings do; the backoff counts alike everywhere)."""

    def __init__(
        self,
        on_fail: OnFail,
        failures: Backoff | None = None,
        errors: Backoff | None = None,
        *,
        verbose: bool = True,
        shown: bool = True,
    ) -> None:
        self.shown = shown
        self.on_fail = on_fail
        self.failures = failures or Backoff()
        self.errors = errors or Backoff()
        self.verbose = verbose
        self.warned_nonfinite = False

    def handle(self, report: CheckReport, call: Callable[..., object] | None = None) -> bool:
        """React to a report; returns whether training should stop. Reports that did not fail are ignored. ``call``
        runs a callable ``on_fail`` (the watch's guard marks its errors as the user's)."""
        if report.verdict != "fail":
            return False
        if self.on_fail == "raise":
            raise GradientCheckError(report)
        if callable(self.on_fail):
            if call is None:
                self.on_fail(report)
            else:
                call(self.on_fail, report)
            return False
        if nonfinite_loss(report):
            self._nonfinite(report)
            return self.on_fail == "stop"
        if self.failures.admit():
            if not self.shown:
                return self.on_fail == "stop"
            message = render_text(report)
            if self.on_fail == "stop":
                message += "\n  stopping training (on_fail='stop')"
            else:
                message += (
                    f"\n  (failing check #{self.failures.count}; the next warning comes at failing check "
                    f"#{self.failures.next_reported}, every report is kept in the reports of the watch)"
                )
            warnings.warn(message, GradientCheckWarning, stacklevel=2)
        elif self.verbose:
            log.info(
                "gradwatch: gradient check failed at step %d (failing check #%d, its warning withheld until #%d)%s",
                report.step,
                self.failures.count,
                self.failures.next_reported,
                f": {report.culprit_message}" if report.culprit_message else "",
            )
        return self.on_fail == "stop"

    def _nonfinite(self, report: CheckReport) -> None:
        """A loss that is not finite: one line, the first time in the run (it stays so once the parameters are not
        finite), then log records (INFO); it is no wrong gradient, so it is kept apart from the failures' backoff."""
        words = f"gradwatch: {nonfinite_loss_words(report)}"
        if self.on_fail == "stop":
            words += "; stopping training (on_fail='stop')"
        if not self.warned_nonfinite:
            self.warned_nonfinite = True
            if self.shown:
                warnings.warn(words, GradientCheckWarning, stacklevel=3)
        elif self.verbose and self.shown:
            log.info(words)

    def check_error(self, step: int, error: Exception) -> None:
        """Report (rate-limited) a check that could not run; training goes on."""
        message = (
            f"gradwatch: the gradient check at step {step} could not run and was skipped "
            f"({type(error).__name__}: {error}); training is unaffected"
        )
        log_traceback(message, error)
        if self.errors.admit():
            warnings.warn(message, GradientCheckWarning, stacklevel=2)
        elif self.verbose:
            log.info(message)


BLIND_AFTER = 3
"""Inconclusive checks in a row after which the run is warned that it checks nothing."""

WEAK_FLOOR = 0.01
"""An applied check whose noise floor along the gradient is above this fraction of ``‖g‖`` is weak, and the run is
told so once: it allows a correct gradient of its path 2 to 3 times its floor, so an error of 3% of ``‖g‖`` (the
size of the faults the benchmarks plant) may pass it (under bf16 autocast a floor reached 10% of ``‖g‖``)."""


class Remarks:
    """What a run's reports say besides their verdicts, said once per run: each distinct note as a log record (INFO,
    only when ``verbose``); a :class:`GradientCheckWarning` the first time a check could not put back what the loss
    changed, the first time :data:`BLIND_AFTER` checks in a row were inconclusive (with the reason and the remedy), the
    first time an applied check found the accumulated gradient unlike the window's as one batch (a loss normalised per
    micro-batch: the gradient is right, the loss is not, so the verdict stays ``"ok"``), and (when ``verbose``) for each
    surrogate gradient a check recognised (with the ``ignore=`` pattern that exempts it); a log record of level WARNING
    the first time an applied check passed weakly (its floor above :data:`WEAK_FLOOR`) or left trainable tensors
    unchecked."""

    def __init__(self, *, verbose: bool = True) -> None:
        self.verbose = verbose
        self._noted: set[str] = set()
        self._said: set[str] = set()  # what was said once already
        self._inconclusive: list[CheckReport] = []  # the inconclusive checks since the last conclusive one

    def _first(self, what: str) -> bool:
        """Whether ``what`` is said for the first time in the run (it is not said again)."""
        first = what not in self._said
        self._said.add(what)
        return first

    def hear(self, report: CheckReport) -> None:
        self._alert_on_blindness(report)
        self._alert_on_weakness(report)
        for note in report.notes:
            if note not in self._noted:  # a note that comes back at every check is said once
                self._noted.add(note)
                if self.verbose:
                    log.info("gradwatch (step %d): %s", report.step, note)
        for finding in report.surrogates:
            if finding not in self._noted and self.verbose:
                self._noted.add(finding)
                warnings.warn(f"gradwatch (step {report.step}): {finding}", GradientCheckWarning, stacklevel=2)
        unequal = report.noted(NoteCode.ACCUMULATION_UNEQUAL)
        if unequal and self._first("unequal"):
            warnings.warn(f"gradwatch (step {report.step}): {unequal[0]}", GradientCheckWarning, stacklevel=2)
        if report.unrestored and self._first("unrestored"):
            warnings.warn(
                f"gradwatch: at step {report.step} training_step changed {', '.join(report.unrestored)} in place and "
                "gradwatch could not put it back, so this run is not exactly as it would be without checks; pass "
                "a loss_fn without that side effect",
                GradientCheckWarning,
                stacklevel=2,
            )

    def _alert_on_weakness(self, report: CheckReport) -> None:
        """A verdict weaker than it reads, said once per run as a log record of level WARNING (no failure, so no
        :class:`GradientCheckWarning`; see :class:`Remarks`)."""
        floor = report.noise_floor  # an update check's floor is its reference's rounding, not the path's
        weak = report.scope == "applied" and math.isfinite(floor) and floor > WEAK_FLOOR
        if report.verdict == "ok" and weak and self._first("weak"):
            passes = f"less than about {3 * floor:.0%} off" if floor < 1 / 3 else "off by as much as its own size"
            log.warning(
                "gradwatch: the applied check at step %d passed, but weakly: the noise floor of the training's path is "
                "%.1f%% of ‖g‖ along the gradient (16-bit rounding), so an applied gradient %s may pass it (a float32 "
                "path resolves far smaller errors)",
                report.step,
                100 * floor,
                passes,
            )
        unchecked = report.noted(NoteCode.APPLIED_UNCHECKED)
        if unchecked and self._first("unchecked"):
            log.warning("gradwatch (step %d): the applied check left %s", report.step, unchecked[0])

    def _alert_on_blindness(self, report: CheckReport) -> None:
        if report.verdict != "inconclusive":
            self._inconclusive.clear()
            return
        self._inconclusive.append(report)
        if len(self._inconclusive) < BLIND_AFTER or not self._first("blind"):
            return
        diagnosis = diagnose(report)
        assert diagnosis is not None
        steps = ", ".join(str(r.step) for r in self._inconclusive)
        message = (
            f"gradwatch: the last {len(self._inconclusive)} checks (steps {steps}) were inconclusive, so the gradients "
            f"are not being checked: {diagnosis.reason}. Remedy: {diagnosis.remedy}"
        )
        warnings.warn(message, GradientCheckWarning, stacklevel=3)
