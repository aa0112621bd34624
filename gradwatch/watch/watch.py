"""``GradientWatch``: both kinds of gradient check over a training run, in any loop, free of any framework. It
composes the recomputed checks' schedule and budget (:mod:`.schedule`), the applied checks' windows on the same clock
(:mod:`.applied`), what checks teach the next ones (:mod:`.lessons`) and what becomes of their reports
(:mod:`.outcomes`: counters, sinks, alerts); adapters only turn their loop's events into its three calls."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn
from typing_extensions import Unpack

from gradwatch.engine import CheckReport, LossFn
from gradwatch.engine import validation as validate
from gradwatch.engine.applied.window import split_note
from gradwatch.engine.settings import ProbeOptions, ProbeSettings, settings_of
from gradwatch.outputs.sinks import Sink
from gradwatch.watch import collective_loss
from gradwatch.watch.alerts import ON_FAIL_CHOICES, GradientCheckWarning, OnFail
from gradwatch.watch.applied import AppliedSchedule
from gradwatch.watch.applied_calls import AppliedCalls
from gradwatch.watch.defaults import (
    DEFAULT_APPLIED_EVERY_N_STEPS,
    DEFAULT_EVERY_N_STEPS,
    DEFAULT_MAX_OVERHEAD,
    DEFAULT_PROBE_BATCH_SIZE,
)
from gradwatch.watch.distributed import agree_across_ranks, rank0_decides, split_ranks
from gradwatch.watch.hooks import Agree, Context, Decide, no_context
from gradwatch.watch.lessons import Lessons
from gradwatch.watch.outcomes import Outcomes
from gradwatch.watch.schedule import Schedule

log = logging.getLogger(__name__)

_STATE_VERSION = 1


class GradientWatch(AppliedCalls):
    r"""Check, every so often during training, that the gradients a model trains on are the derivatives of its loss.

    Both kinds of check, in any loop, on one schedule and one budget, with three calls each a no-op unless a check is
    due (the page "gradwatch in every training loop" has a recipe per loop):

    * :meth:`record` before each micro-batch's forward, and :meth:`before_optimizer_step` after the window's backward
      passes, before clipping and ``optimizer.step()``: the **applied** check, the ``.grad`` the optimizer is about to
      apply against the loss of the whole window (:func:`gradwatch.check_applied_gradient`);
    * :meth:`maybe_check` after ``optimizer.step()``: the **recomputed** check of the loss of the step's batch at the
      current parameters (:func:`gradwatch.check_gradients`).

    A check never changes training: the parameters, buffers, ``.grad``, optimizer and random states are left bit for
    bit as they were. Steps are optimizer steps (1 for the first). Every option is keyword-only; the probe options
    (``tensor_probes``, ``precision``, ``ignore``, ...) are documented once, in
    :class:`~gradwatch.engine.settings.ProbeSettings`, and may be given as ``settings=`` instead.

    Args:
        every_n_steps: A recomputed check every this many optimizer steps; ``None`` (the default): every 500
            (``DEFAULT_EVERY_N_STEPS``), within the budget of ``max_overhead``.
        first_check_step: Also check (both kinds) at this optimizer step, so a wrong gradient surfaces in the first
            minutes of a run; ``None`` to rely on the cadences alone.
        applied_every_n_steps: An applied check every this many optimizer steps (``None``: none), within the same
            budget; 5000 by default (``DEFAULT_APPLIED_EVERY_N_STEPS``).
        on_fail: ``"warn"`` (a :class:`~gradwatch.GradientCheckWarning` naming the culprit, the tensor and index,
            rate-limited), ``"raise"`` (:class:`~gradwatch.GradientCheckError`), ``"stop"`` (warn and set
            :attr:`should_stop`) or a callable receiving the failing :class:`~gradwatch.CheckReport`.
        loss_fn: ``loss_fn(model, batch) -> scalar Tensor``, the loss to check when a call is given none.
        max_overhead: The budget both kinds share: a due check is postponed while gradwatch's time, with that check,
            would exceed this fraction of the training time (measured between calls); the first recomputed check is
            always made, and measures the cost. 1% by default (``DEFAULT_MAX_OVERHEAD``) whatever the cadence, one
            chosen by hand included; ``None``: none (``every_n_steps=1, max_overhead=None`` checks every step).
            ``"auto"``, the rule of earlier versions: 1% at the default cadence, none for a cadence chosen by hand.
        max_reports: How many reports :attr:`reports` keeps (the oldest are dropped).
        verbose: Log (INFO) what is no failure: notes once each, postponements, warnings the backoff withholds.
        settings: The probe options as one :class:`~gradwatch.engine.settings.ProbeSettings` (then none one by one);
            a series of checks probes 2 samples unless told (``DEFAULT_PROBE_BATCH_SIZE``).
        sinks: Where the records of every check go (``sink.write(records)``; ``sink.flush()`` after a failure).
        decide: The budget decision every process takes, from this process's proposal (0 to check now, else the
            steps to wait); by default rank 0's (:mod:`gradwatch.watch.distributed`; in one process, the proposal).
        agree: ``agree(report, error, step)``: the report every process acts on, from this process's recomputed
            report or error; by default the most severe process's (:mod:`gradwatch.watch.distributed`).
        context: ``context(model)``, a context manager around each check (silenced loggers).
        on_report: Called with each report after it is recorded and written to the sinks, before ``on_fail`` acts.
        check_update: At each step whose gradient an applied check verified, also check the update the optimizer
            makes of it against a reference update (``scope == "update"``; :mod:`gradwatch.watch.update_calls`);
            ``False``: no update check.
        **options: The probe options by name (``probe_batch_size``, ``precision``, ``ignore``, ``rtol``, ...): the
            fields of :class:`~gradwatch.engine.settings.ProbeSettings`.

    Raises ``ValueError`` at construction for an argument out of range or of the wrong type.

    Example:
        >>> import torch
        >>> from gradwatch import GradientWatch
        >>> model, watch = torch.nn.Linear(4, 1), GradientWatch(every_n_steps=2, applied_every_n_steps=2)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        >>> for step in range(1, 5):
        ...     batch = (torch.randn(8, 4), torch.randn(8, 1))
        ...     watch.record(batch)
        ...     loss_fn(model, batch).backward()
        ...     watch.before_optimizer_step(model, loss_fn, step=step)
        ...     optimizer.step()
        ...     optimizer.zero_grad()
        ...     report = watch.maybe_check(model, batch, loss_fn, step=step)
        >>> print(", ".join(f"{report.scope} {report.step}" for report in watch.reports))
        applied 1, recomputed 1, applied 2, recomputed 2, recomputed 4
    """

    @validate.suggests_options(ProbeOptions)
    def __init__(
        self,
        *,
        every_n_steps: int | None = None,
        first_check_step: int | None = 1,
        applied_every_n_steps: int | None = DEFAULT_APPLIED_EVERY_N_STEPS,
        on_fail: OnFail = "warn",
        loss_fn: LossFn | None = None,
        max_overhead: float | Literal["auto"] | None = DEFAULT_MAX_OVERHEAD,
        max_reports: int = 1000,
        verbose: bool = True,
        settings: ProbeSettings | None = None,
        sinks: Sequence[Sink] = (),
        decide: Decide | None = None,
        agree: Agree | None = None,
        context: Context | None = None,
        on_report: Callable[[CheckReport], object] | None = None,
        check_update: bool = True,
        **options: Unpack[ProbeOptions],
    ) -> None:
        chosen = validate.check_optional_int("every_n_steps", every_n_steps, minimum=1)
        self.every_n_steps = DEFAULT_EVERY_N_STEPS if chosen is None else chosen
        self.first_check_step = validate.check_optional_int("first_check_step", first_check_step, minimum=1)
        self.applied_every_n_steps = validate.check_optional_int(
            "applied_every_n_steps", applied_every_n_steps, minimum=1
        )
        self.on_fail = validate.check_choice("on_fail", on_fail, ON_FAIL_CHOICES, allow_callable=True)
        self.loss_fn = validate.check_optional_callable("loss_fn", loss_fn)
        if max_overhead == "auto":
            self.max_overhead = DEFAULT_MAX_OVERHEAD if chosen is None else None
        else:
            self.max_overhead = validate.check_fraction("max_overhead", max_overhead, optional=True, auto=True)
        self.settings = settings_of(settings, options, {"probe_batch_size": DEFAULT_PROBE_BATCH_SIZE})
        self.max_reports = validate.check_int("max_reports", max_reports, minimum=1)
        self.verbose = validate.check_bool("verbose", verbose)
        self.check_update = validate.check_bool("check_update", check_update)
        self._update_reset()
        self._decide = decide or rank0_decides
        self._agree = agree or agree_across_ranks
        self._context = context or no_context
        self._outcomes = Outcomes(self.on_fail, self.max_reports, self.verbose, sinks, on_report)
        self._lessons = Lessons(self.settings)  # what the checks taught the next ones
        self._model: nn.Module | None = None  # the model of the last call, whose windows record() fingerprints
        self._schedule = Schedule(self.every_n_steps, self.first_check_step, self.max_overhead, verbose=self.verbose)
        self._applied = AppliedSchedule(
            self.applied_every_n_steps, self.first_check_step, self.max_overhead, self._schedule.clock
        )
        self._last_step = 0  # the last optimizer step a call named: record() keeps windows for the one after it
        self._split_models: dict[int, bool] = {}  # by model: whether its ranks hold other parameters (a split by hand)

    @property
    def sinks(self) -> tuple[Sink, ...]:
        """Where the records of every check go (an adapter may set them once its loop's loggers exist)."""
        return self._outcomes.sinks

    @sinks.setter
    def sinks(self, sinks: Sequence[Sink]) -> None:
        self._outcomes.sinks = tuple(sinks)

    @property
    def should_stop(self) -> bool:
        """``True`` once a check failed under ``on_fail="stop"``: the loop should stop (set it back to go on)."""
        return self._outcomes.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._outcomes.should_stop = bool(value)

    @property
    def reports(self) -> list[CheckReport]:
        """This run's reports of both kinds (``report.scope``), oldest first (at most ``max_reports``)."""
        return list(self._outcomes.reports)

    @property
    def applied_reports(self) -> list[CheckReport]:
        """This run's reports with ``scope == "applied"``, oldest first."""
        return [report for report in self._outcomes.reports if report.scope == "applied"]

    @property
    def update_reports(self) -> list[CheckReport]:
        """This run's reports with ``scope == "update"``, oldest first."""
        return [report for report in self._outcomes.reports if report.scope == "update"]

    @property
    def recomputed_reports(self) -> list[CheckReport]:
        """This run's reports with ``scope == "recomputed"``, oldest first."""
        return [report for report in self._outcomes.reports if report.scope == "recomputed"]

    @property
    def counts(self) -> dict[str, int]:
        """Checks run, failed, skipped, postponed (over budget), applied and update checks run and failed (kept on
        resume)."""
        return {**self._outcomes.counts, "postponed": self._schedule.postponed}

    @property
    def overhead(self) -> float:
        """gradwatch's time so far as a fraction of the training time (measured between calls)."""
        return self._schedule.clock.fraction

    def due(self, previous_step: int, step: int) -> bool:
        """Whether a recomputed check is due after the optimizer steps ``previous_step < s <= step``.

        Args:
            previous_step: The last optimizer step already considered.
            step: The optimizer step just taken.
        """
        with self.guarded("watch.due"):
            return self._schedule.due(previous_step, step)
        return False

    def due_next(self, step: int) -> bool:  # a recomputed check, e.g. to read a grad scaler's scale before it
        """Whether a recomputed check is (or stays) due at the optimizer step after ``step``.

        Args:
            step: The optimizer step just taken.
        """
        with self.guarded("watch.due_next"):
            return self._schedule.due_next(step)
        return False

    @property
    def recording(self) -> bool:
        """Whether the window being run is kept for an applied check at its optimizer step."""
        return bool(self._applied.windows)

    def start(self, step: int = 0) -> None:
        """Training (re)starts: the time until the next call is not training time.

        Args:
            step: The optimizer steps already taken (0 for a new run; a resumed run's step).
        """
        with self.guarded("watch.start"):
            self._schedule.start(step)
            self._last_step = step

    def setup(self, model: nn.Module) -> None:
        """Match the ``ignore`` patterns to the model's parameter names (each that matches none warns once); the first
        check does it if not done before.

        Args:
            model: The model the checks will see.
        """
        self._model = model
        with self.guarded("watch.setup"):
            self._lessons.set_up(model)

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
        self._update_release()  # the update check's one-shot hooks, once they have run
        loss_fn = self._loss_fn(loss_fn, step)
        self._model, self._last_step = model, max(self._last_step, step)
        with self.guarded("watch.maybe_check"):
            if not self._schedule.step_ended(step, now):
                return None
            if skipped() if callable(skipped) else skipped:
                # the check stays pending and runs at the next optimizer step
                self._outcomes.counts["skipped"] += 1
                if self.verbose:
                    log.info("gradwatch: the grad scaler skipped step %d; the check moves to the next step", step)
                return None
            if not self._schedule.runs_now(step, self._decide):
                return None
            return self._run(model, batch, loss_fn, step, now, tuple(optimizers))
        return None

    def check(
        self, model: nn.Module, batch: Any, loss_fn: LossFn | None = None, *, step: int,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> CheckReport | None:  # fmt: skip
        """Check now, whatever the schedule; recorded, counted and alerted like a scheduled check.

        Args:
            model: The model to check.
            batch: The batch whose loss is checked (its first ``probe_batch_size`` samples).
            loss_fn: ``loss_fn(model, batch) -> scalar Tensor``; the watch's own by default.
            step: The optimizer steps taken so far, recorded on the report.
            optimizers: Optimizers whose state the check puts back if the loss changes it.

        Returns:
            The report, or ``None`` when the check was skipped (an error the alert reported, no loss, no trainable
            parameter).
        """
        loss_fn = self._loss_fn(loss_fn, step)
        with self.guarded("watch.check"):
            return self._run(model, batch, loss_fn, step, time.perf_counter(), tuple(optimizers))
        return None

    def flush(self) -> None:
        """Flush every sink."""
        for sink in self._outcomes.sinks:
            with self.guarded(f"the sink {type(sink).__name__}"):
                sink.flush()

    def _run(
        self, model: nn.Module, batch: Any, loss_fn: LossFn, step: int, started: float,
        optimizers: tuple[torch.optim.Optimizer, ...],
    ) -> CheckReport | None:  # fmt: skip
        if not self._lessons.checkable(model) or self._split(model):
            self._outcomes.counts["skipped"] += 1
            return None
        self._lessons.set_up(model, force=False)
        lessons = self._lessons
        check = lambda: collective_loss.recomputed_check(  # noqa: E731
            model, batch, loss_fn, step=step, settings=lessons.active, rotation=self._outcomes.counts["checks"],
            focus=lessons.focus, optimizers=optimizers,
        )  # fmt: skip
        report = self._outcomes.agreed(step, check, self._contexts(model, local=True), self._agree)
        with self.guarded("the budget's clock"):
            self._schedule.ran(started, time.perf_counter())
        if report is not None:
            with self.guarded("the lessons of a check"):
                self._lessons.learn(report)
            self._outcomes.publish(report, self._schedule.overhead())
        return report

    def _split(self, model: nn.Module) -> bool:
        """Whether the ranks hold other parameters than rank 0 (a model split by hand), asked once per model on every
        rank together before its first recomputed check, and said once: such a model is not checked."""
        if id(model) not in self._split_models:
            ranks = split_ranks(model)
            self._split_models[id(model)] = bool(ranks)
            if ranks:
                text = split_note(ranks).replace("this applied check does not", "recomputed checks do not")
                warnings.warn(
                    f"gradwatch: no recomputed checks in this run: {text}", GradientCheckWarning, stacklevel=3
                )
        return self._split_models[id(model)]

    def state_dict(self) -> dict[str, Any]:
        """The state a checkpoint carries over (plain values: ``torch.load(weights_only=True)`` reads it); only the
        version when it cannot be read (said once, see :meth:`guarded`)."""
        with self.guarded("watch.state_dict"):
            return self._state_dict()
        return {"version": _STATE_VERSION}

    def _state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            **self._outcomes.state_dict(),
            "focus": list(self._lessons.focus),
            **self._schedule.state_dict(),
            **self._applied.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (keys missing from an older version take their defaults).

        Args:
            state_dict: What :meth:`state_dict` returned.
        """
        with self.guarded("watch.load_state_dict"):
            self._outcomes.load_state_dict(state_dict)
            self._lessons.focus = tuple(str(name) for name in state_dict.get("focus", ()))
            self._schedule.load_state_dict(state_dict)
            self._applied.load_state_dict(state_dict)
            self._last_step = int(state_dict.get("last_step", 0))
