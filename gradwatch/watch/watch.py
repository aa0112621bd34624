"""``GradientWatch``: a series of gradient checks over a training run, in any training loop, free of any framework:
the schedule and its budget (:mod:`.schedule`), the rotation of the probed tensors and the focus on those a check could
not decide, the probe slice the loss accepts, vectorised passes given up, the alerts (:mod:`.alerts`), the counters and
the checkpoint state. Adapters (Lightning's ``GradWatch``, Hugging Face's ``GradWatchCallback``) turn their loop's
events into :meth:`GradientWatch.maybe_check`, lending what only the loop knows through the constructor's keywords.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from gradwatch.engine import CheckReport, LossFn, check_gradients
from gradwatch.engine import validation as validate
from gradwatch.engine.function.precision import Precision
from gradwatch.engine.report import UnrestoredStateWarning
from gradwatch.engine.selection import unmatched_patterns
from gradwatch.engine.settings import ProbeSettings
from gradwatch.outputs.records import records_of
from gradwatch.outputs.sinks import Sink
from gradwatch.watch.alerts import ON_FAIL_CHOICES, AlertPolicy, Backoff, GradientCheckWarning, OnFail, Remarks
from gradwatch.watch.defaults import DEFAULT_EVERY_N_STEPS, DEFAULT_MAX_OVERHEAD, DEFAULT_PROBE_BATCH_SIZE
from gradwatch.watch.hooks import Agree, Context, Decide, NoLossToCheckError, as_decided, no_context
from gradwatch.watch.schedule import Schedule

log = logging.getLogger(__name__)

_STATE_VERSION = 1


class GradientWatch:
    r"""Check, every so often during training, that the gradients autograd computes are the derivatives of the loss.

    Call :meth:`maybe_check` once per optimizer step, after ``optimizer.step()``; at the steps the schedule and the
    budget choose, it runs a check (:func:`gradwatch.check_gradients`) of the loss on the step's batch at the current
    parameters and returns its :class:`~gradwatch.CheckReport`, else ``None``. A check never changes training: the
    parameters, buffers, ``.grad``, optimizer and random states are left bit for bit as they were.

    Steps are optimizer steps. Under gradient accumulation, call it once per optimizer step with the optimizer step's
    number and one micro-batch (the check is of that micro-batch's loss); a second call with the same step is ignored.
    The probe options (``precision`` to ``seed`` in the signature) are documented once, in
    :class:`~gradwatch.engine.settings.ProbeSettings`; ``ignore`` patterns that match no parameter warn once, at the
    first check (or :meth:`setup`).

    Args:
        every_n_steps: Check every this many optimizer steps; by default every :data:`DEFAULT_EVERY_N_STEPS`, within
            the budget of ``max_overhead``.
        first_check_step: Also check at this optimizer step, so a wrong gradient surfaces in the first minutes of a
            run; ``None`` to rely on ``every_n_steps`` alone.
        on_fail: ``"warn"`` (a :class:`~gradwatch.GradientCheckWarning` naming the culprit, the tensor and index,
            rate-limited), ``"raise"`` (:class:`~gradwatch.GradientCheckError`), ``"stop"`` (warn and set
            :attr:`should_stop`) or a callable receiving the failing :class:`~gradwatch.CheckReport`.
        loss_fn: ``loss_fn(model, batch) -> scalar Tensor``, the loss to check when :meth:`maybe_check` is given none.
        probe_batch_size: Probe the loss of the first this many samples of the batch (``None``: the whole batch); two
            by default (:data:`DEFAULT_PROBE_BATCH_SIZE`). See :class:`~gradwatch.engine.settings.ProbeSettings`.
        max_overhead: The budget: a due check is postponed while gradwatch's time, with that check, would exceed
            this fraction of the training time (measured between calls of :meth:`maybe_check`); the first check is
            always made, and measures the cost. ``"auto"`` (the default): :data:`DEFAULT_MAX_OVERHEAD` (1%) when
            ``every_n_steps`` is left at its default, no budget when you choose a cadence yourself. ``None``: no
            budget.
        max_reports: How many reports :attr:`reports` keeps (the oldest are dropped).
        verbose: Log what is worth knowing but is no failure (INFO records: a report's notes, once each; postponed
            checks; failing checks whose warning the backoff withholds). ``False``: no INFO records, and warnings
            only for failures, checks that could not run, and checks that cannot see or that changed the run.

    Keyword Args:
        sinks: Where the records of every check go (``sink.write(records)``; ``sink.flush()`` after a failure).
        decide: The budget decision every process takes: called with this process's proposal (0 to check now, else
            the steps to wait), returns the decision (under DDP, rank 0's, broadcast). Default: the proposal.
        agree: ``agree(report, error, step)``: under DDP, turns this process's report (or the error that ended its
            check) into the report every process acts on (a gather). Called on every check when given.
            :mod:`gradwatch.watch.distributed` has both, for any ``torch.distributed`` run.
        context: ``context(model)``, a context manager around each check (silenced loggers, local batch norm).
        on_report: Called with each report after it is recorded and written to the sinks, before ``on_fail`` acts.

    Raises:
        ValueError: An argument is out of range or of the wrong type (at construction).

    Example:
        >>> import torch
        >>> from gradwatch import GradientWatch
        >>> model, watch = torch.nn.Linear(4, 1), GradientWatch(every_n_steps=2)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        >>> for step in range(1, 5):
        ...     batch = (torch.randn(8, 4), torch.randn(8, 1))
        ...     optimizer.zero_grad()
        ...     loss_fn(model, batch).backward()
        ...     optimizer.step()
        ...     report = watch.maybe_check(model, batch, loss_fn, step=step)
        >>> [report.step for report in watch.reports], watch.counts["failed"]
        ([1, 2, 4], 0)
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        first_check_step: int | None = 1,
        on_fail: OnFail = "warn",
        loss_fn: LossFn | None = None,
        probe_batch_size: int | None = DEFAULT_PROBE_BATCH_SIZE,
        max_overhead: float | Literal["auto"] | None = "auto",
        precision: Precision = "auto",
        vectorize: bool = True,
        fail_on_imprecise: bool = False,
        ignore: list[str] | tuple[str, ...] = (),
        tensor_probes: int = 6,
        random_probes: int = 1,
        param_probes: int = 1,
        input_probes: int = 1,
        rtol: float | None = None,
        seed: int = 0,
        max_reports: int = 1000,
        verbose: bool = True,
        *,
        sinks: Sequence[Sink] = (),
        decide: Decide | None = None,
        agree: Agree | None = None,
        context: Context | None = None,
        on_report: Callable[[CheckReport], object] | None = None,
    ) -> None:
        chosen = validate.check_optional_int("every_n_steps", every_n_steps, minimum=1)
        self.every_n_steps = DEFAULT_EVERY_N_STEPS if chosen is None else chosen
        self.first_check_step = validate.check_optional_int("first_check_step", first_check_step, minimum=1)
        self.on_fail = validate.check_choice("on_fail", on_fail, ON_FAIL_CHOICES, allow_callable=True)
        self.loss_fn = validate.check_optional_callable("loss_fn", loss_fn)
        if max_overhead == "auto":
            self.max_overhead = DEFAULT_MAX_OVERHEAD if chosen is None else None
        else:
            self.max_overhead = validate.check_fraction("max_overhead", max_overhead, optional=True, auto=True)
        self.settings = ProbeSettings(
            tensor_probes=tensor_probes,
            random_probes=random_probes,
            param_probes=param_probes,
            input_probes=input_probes,
            probe_batch_size=probe_batch_size,
            precision=precision,
            ignore=ignore,  # type: ignore[arg-type]  # a list is validated and kept as a tuple
            rtol=rtol,
            seed=seed,
            vectorize=vectorize,
            fail_on_imprecise=fail_on_imprecise,
        )
        self.max_reports = validate.check_int("max_reports", max_reports, minimum=1)
        self.verbose = validate.check_bool("verbose", verbose)
        self.sinks = tuple(sinks)
        self._decide = decide or as_decided
        self._agree = agree
        self._context = context or no_context
        self._on_report = on_report
        self.should_stop = False  # on_fail="stop" and a check failed: the loop should stop
        # what the checks taught: the probe slice the loss accepts, whether it vectorises, the patterns that match
        self._active = self.settings
        self._set_up_for: int | None = None  # id of the model the ignore patterns were matched to
        self._reports: deque[CheckReport] = deque(maxlen=self.max_reports)
        self._alerts = AlertPolicy(self.on_fail, verbose=self.verbose)
        self._checks = 0
        self._failed_checks = 0
        self._skipped_checks = 0
        self._focus: tuple[str, ...] = ()  # tensors the last check could not decide or saw fail: probed again next
        self._schedule = Schedule(self.every_n_steps, self.first_check_step, self.max_overhead)
        self._warned_no_params = False
        self._remarks = Remarks(verbose=self.verbose)

    @property
    def reports(self) -> list[CheckReport]:
        """The reports of this run's checks, oldest first (at most ``max_reports``)."""
        return list(self._reports)

    @property
    def counts(self) -> dict[str, int]:
        """Checks run, failed, skipped (an error, no loss, or a step the grad scaler skipped) and postponed (over
        budget) so far in this run (restored on resume)."""
        return {
            "checks": self._checks,
            "failed": self._failed_checks,
            "skipped": self._skipped_checks,
            "postponed": self._schedule.postponed,
        }

    @property
    def overhead(self) -> float:
        """gradwatch's time so far as a fraction of the training time (measured between calls)."""
        return self._schedule.clock.fraction

    def due(self, previous_step: int, step: int) -> bool:
        """Whether a check is due after the optimizer steps ``previous_step < s <= step``."""
        return self._schedule.due(previous_step, step)

    def due_next(self, step: int) -> bool:
        """Whether a check is (or stays) due at the optimizer step after ``step`` (to prepare for it, e.g. read a grad
        scaler's scale before that step)."""
        return self._schedule.due_next(step)

    def start(self, step: int = 0) -> None:
        """Training (re)starts at optimizer step ``step``: the time until the next call is not training time."""
        self._schedule.start(step)

    def setup(self, model: nn.Module) -> None:
        """Match the ``ignore`` patterns to the model's parameter names: each pattern that matches none warns once,
        with the names meant; the checks then get only the patterns that match. The first check does it if not
        done before."""
        self._set_up_for = id(model)
        names = [name for name, _ in model.named_parameters()]
        for message in unmatched_patterns(self.settings.ignore, names):
            warnings.warn(f"gradwatch: {message}", GradientCheckWarning, stacklevel=3)
        matched = tuple(p for p in self.settings.ignore if any(fnmatch.fnmatchcase(name, p) for name in names))
        self._active = dataclasses.replace(self._active, ignore=matched)

    def maybe_check(
        self,
        model: nn.Module,
        batch: Any,
        loss_fn: LossFn | None = None,
        *,
        step: int,
        skipped: bool | Callable[[], bool] = False,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> CheckReport | None:
        """Check ``loss_fn(model, batch)`` if a check is due at optimizer step ``step`` and fits the budget.

        Args:
            model: The module whose trainable floating parameters are checked.
            batch: The step's batch (or one micro-batch of it), as ``loss_fn`` takes it.
            loss_fn: ``loss_fn(model, batch) -> scalar Tensor``; the constructor's when ``None``.
            step: The number of optimizer steps taken so far (1 after the first).
            skipped: Whether the optimizer skipped this step (a grad scaler that found non-finite gradients), or a
                function that says so, called only at a due step: the due check moves to the next step.
            optimizers: The loop's optimizers: if the loss changes their state (steps one, changes a learning rate),
                the check puts it back (see :func:`gradwatch.check_gradients`).

        Returns:
            The check's report, or ``None`` when no check ran (not due, postponed, skipped).
        """
        now = time.perf_counter()
        loss_fn = self._loss_fn(loss_fn, step)
        if not self._schedule.step_ended(step, now):
            return None
        if skipped() if callable(skipped) else skipped:
            # the check stays pending and runs at the next optimizer step
            self._skipped_checks += 1
            if self.verbose:
                log.info("gradwatch: the grad scaler skipped optimizer step %d; the check moves to the next step", step)
            return None
        if not self._schedule.runs_now(step, lambda wait: self._decided(step, wait)):
            return None
        return self._run(model, batch, loss_fn, step, now, tuple(optimizers))

    def check(
        self, model: nn.Module, batch: Any, loss_fn: LossFn | None = None, *, step: int,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> CheckReport | None:  # fmt: skip
        """Check now, whatever the schedule; recorded, counted and alerted like a scheduled check. ``None`` when the
        check was skipped (an error the alert reported, no loss, no trainable parameter)."""
        return self._run(model, batch, self._loss_fn(loss_fn, step), step, time.perf_counter(), tuple(optimizers))

    def flush(self) -> None:
        """Flush every sink."""
        for sink in self.sinks:
            sink.flush()

    def _loss_fn(self, loss_fn: LossFn | None, step: int) -> LossFn:
        validate.check_int("step", step, minimum=0)
        chosen = validate.check_optional_callable("loss_fn", loss_fn if loss_fn is not None else self.loss_fn)
        if chosen is None:
            raise ValueError("`loss_fn` must be given, to the watch or to this call: gradwatch needs the loss to check")
        return chosen

    def _decided(self, step: int, wait: int) -> int:
        wait = int(self._decide(wait))
        if wait and not self._schedule.postponed and self.verbose:
            log.info(
                "gradwatch: the check due at step %d is postponed by %d steps, so that checks cost at most %g of the "
                "training time (max_overhead); max_overhead=None checks on schedule",
                step,
                wait,
                self.max_overhead,
            )
        return wait

    def _run(
        self, model: nn.Module, batch: Any, loss_fn: LossFn, step: int, started: float,
        optimizers: tuple[torch.optim.Optimizer, ...],
    ) -> CheckReport | None:  # fmt: skip
        try:
            report = self._attempt(model, batch, loss_fn, step, optimizers)
        except Exception as error:
            # on_fail="raise": under DDP every process must learn of it before any raises, or the others would wait
            if self._agree is not None:
                self._agree(None, error, step)
            raise
        if self._agree is not None:
            report = self._agree(report, None, step)
        self._schedule.ran(started, time.perf_counter())
        if report is None:
            return None
        self._record(report)
        for sink in self.sinks:
            sink.write(records_of(report, overhead=self.overhead))
            if report.verdict == "fail":
                sink.flush()
        if self._on_report is not None:
            self._on_report(report)
        if self._alerts.handle(report):
            self.should_stop = True
        return report

    def _attempt(
        self, model: nn.Module, batch: Any, loss_fn: LossFn, step: int, optimizers: tuple[torch.optim.Optimizer, ...]
    ) -> CheckReport | None:
        if not any(p.requires_grad and p.is_floating_point() for p in model.parameters()):
            self._skipped_checks += 1
            if not self._warned_no_params:
                self._warned_no_params = True
                warnings.warn(
                    f"gradwatch: {type(model).__name__} has no trainable floating-point parameter (layers kept in "
                    "a plain list or dict are not registered); its checks are skipped",
                    GradientCheckWarning,
                    stacklevel=4,
                )
            return None
        if self._set_up_for != id(model):
            self.setup(model)
        try:
            with self._context(model), warnings.catch_warnings():
                # what a check could not put back is warned of once per run, by the remarks
                warnings.simplefilter("ignore", UnrestoredStateWarning)
                return self._check_gradients(
                    model, batch, loss_fn, step=step, settings=self._active, rotation=self._checks, focus=self._focus,
                    optimizers=optimizers,
                )  # fmt: skip
        except NoLossToCheckError:
            self._skipped_checks += 1
            log.debug("gradwatch: the loss_fn had no loss at step %d; check skipped", step)
        except Exception as error:
            # The one deliberate catch-all: a check must never end a training run (the engine has already restored
            # the model exactly). on_fail="raise" asks for the opposite.
            if self.on_fail == "raise":
                raise
            self._skipped_checks += 1
            self._alerts.check_error(step, error)
        return None

    def _check_gradients(self, model: nn.Module, batch: Any, loss_fn: LossFn, **arguments: Any) -> CheckReport:
        """One check (an adapter may override it to observe the arguments each check gets)."""
        return check_gradients(model, batch, loss_fn, **arguments)

    def _record(self, report: CheckReport) -> None:
        self._reports.append(report)
        self._checks += 1
        samples = self._active.probe_batch_size
        if samples is not None and report.samples is not None and report.samples > samples:
            # the loss refused the smaller slice: no need to try it again
            self._active = dataclasses.replace(self._active, probe_batch_size=report.samples)
        retried = report.failed_tensors[: self._active.tensor_probes]  # a wrong gradient is confirmed at every check
        self._focus = tuple(dict.fromkeys([*report.undecided, *retried]))
        if report.vectorized is False:
            # the loss could not be vectorised: the next checks need not try again
            self._active = dataclasses.replace(self._active, vectorize=False)
        self._failed_checks += report.verdict == "fail"
        self._remarks.hear(report)
        log.debug("gradwatch %s", report.summary())

    def state_dict(self) -> dict[str, Any]:
        """The state a checkpoint carries over (plain values: ``torch.load(weights_only=True)`` reads it)."""
        return {
            "version": _STATE_VERSION,
            "checks": self._checks,
            "failed_checks": self._failed_checks,
            "skipped_checks": self._skipped_checks,
            "focus": list(self._focus),
            **self._schedule.state_dict(),
            "failure_warnings": self._alerts.failures.count,
            "error_warnings": self._alerts.errors.count,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (keys missing from an older version take their defaults)."""
        self._checks = int(state_dict.get("checks", 0))
        self._failed_checks = int(state_dict.get("failed_checks", 0))
        self._skipped_checks = int(state_dict.get("skipped_checks", 0))
        self._focus = tuple(str(name) for name in state_dict.get("focus", ()))
        self._schedule.load_state_dict(state_dict)
        self._alerts = AlertPolicy(
            self.on_fail,
            Backoff(int(state_dict.get("failure_warnings", 0))),
            Backoff(int(state_dict.get("error_warnings", 0))),
            verbose=self.verbose,
        )
