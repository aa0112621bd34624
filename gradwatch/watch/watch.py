"""``GradientWatch``: both kinds of gradient check over a training run, in any loop, free of any framework.

It composes the checks' cadences and their one budget (:mod:`.cadence`, on the clock of :mod:`.overhead`), the
windows the applied checks record and what those checks found (:mod:`.applied`), the update checks they lead to
(:mod:`.updates`), what checks teach the next ones (:mod:`.lessons`) and what becomes of their reports
(:mod:`.outcomes`: counters, sinks, alerts); adapters only turn their loop's events into its calls.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn
from typing_extensions import Unpack

from gradwatch.engine import CheckReport, LossFn, check_gradients
from gradwatch.engine import validation as validate
from gradwatch.engine.applied.clipping import GradientNorms
from gradwatch.engine.applied.equivalence import Join
from gradwatch.engine.applied.probes import deferred
from gradwatch.engine.applied.window import AppliedWindow, Combine, PathContext
from gradwatch.engine.distributed.parameters import is_sharded
from gradwatch.engine.distributed.zero import FullGradients, clipped_norm, is_engine, unwrapped
from gradwatch.engine.probing.search_budget import SearchBudget
from gradwatch.engine.recomputed.collective_loss import split_check
from gradwatch.engine.results.notes import Note
from gradwatch.engine.selection import checked_parameters
from gradwatch.engine.settings import ProbeOptions, ProbeSettings, settings_of
from gradwatch.outputs.sinks import Sink
from gradwatch.watch.alerts import ON_FAIL_CHOICES, GradientCheckWarning, OnFail
from gradwatch.watch.applied import Findings, Verified, Windows
from gradwatch.watch.cadence import APPLIED_KEYS, RECOMPUTED_KEYS, Cadence
from gradwatch.watch.defaults import (
    DEFAULT_APPLIED_EVERY_N_STEPS,
    DEFAULT_EVERY_N_STEPS,
    DEFAULT_MAX_CULPRIT_SEARCH_STEPS,
    DEFAULT_MAX_OVERHEAD,
    DEFAULT_PROBE_BATCH_SIZE,
)
from gradwatch.watch.distributed import agree_across_ranks, default_group, rank0_decides, split_ranks
from gradwatch.watch.hooks import Agree, Context, Decide, TrainingPath, local_batch_norm
from gradwatch.watch.lessons import Lessons
from gradwatch.watch.optimized import clip_check, gradients_of, optimizer_argument, updated_parameters
from gradwatch.watch.outcomes import Outcomes
from gradwatch.watch.overhead import OverheadClock
from gradwatch.watch.rewind import Earlier, rewound
from gradwatch.watch.updates import UpdateChecks, zero_engine

log = logging.getLogger(__name__)

_STATE_VERSION = 1

UNREAD_GRADIENT = (
    "gradwatch: the applied check of step {step} reads no gradient: no checked parameter has a .grad when "
    "before_optimizer_step is called, so every applied check is inconclusive. An engine that keeps the gradients "
    "elsewhere (DeepSpeed ZeRO's partitions): hand the engine itself to the watch (watch.before_optimizer_step(engine, "
    "loss_fn, step=step)) or its gradients as gradients= (gradwatch.integrations.deepspeed.FullGradients(engine)); "
    "otherwise call it after the window's backward passes and before zero_grad (said once)"
)


class GradientWatch:
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
        max_overhead: The budget both kinds share: a due check waits while gradwatch's time with it would exceed this
            fraction of the training time (measured between calls); the first checks are always made, a one-time
            cost. 1% by default (``DEFAULT_MAX_OVERHEAD``), whatever the cadence; ``None``: none (``every_n_steps=1,
            max_overhead=None`` checks every step); ``"auto"``: 1% at the default cadence, none for a chosen one.
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
        max_culprit_search_steps: The most a failing check's localisation (its sweep of the tensors, then its
            culprit search) may take, in training steps at the run's mean step (at the first optimizer step, before
            one is timed, an applied check's forward and backward of its window stands in), never under 30 s
            (``MIN_CULPRIT_SEARCH_SECONDS``); one that runs out stays ``"fail"``, names the deepest module it proved
            and the candidates left, and the next failing check goes on from there (in :meth:`state_dict`). 100 by
            default (``DEFAULT_MAX_CULPRIT_SEARCH_STEPS``); ``None``: no cap.
        check_update: Where an applied check verified the gradient, check the optimizer's update of it against a
            reference update (``scope == "update"``; :mod:`gradwatch.watch.updates`); ``False``: none.
        **options: The probe options by name (``probe_batch_size``, ``precision``, ``ignore``, ``rtol``, ...): the
            fields of :class:`~gradwatch.engine.settings.ProbeSettings`.

    Raises ``ValueError`` at construction for an argument out of range or of the wrong type.

    Example:
        >>> import torch
        >>> from gradwatch import GradientWatch
        >>> watch = GradientWatch(every_n_steps=2, applied_every_n_steps=2, max_overhead=None)  # on schedule
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        >>> for step in range(1, 5):
        ...     batch = (torch.randn(8, 4), torch.randn(8, 1))
        ...     watch.record(batch)
        ...     loss_fn(model, batch).backward()
        ...     applied = watch.before_optimizer_step(model, loss_fn, step=step)
        ...     optimizer.step()
        ...     optimizer.zero_grad()
        ...     report = watch.maybe_check(model, batch, loss_fn, step=step)
        >>> print(", ".join(f"{report.scope} {report.step}" for report in watch.reports))
        applied 1, update 1, recomputed 1, applied 2, update 2, recomputed 2, applied 4, update 4, recomputed 4
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
        max_culprit_search_steps: int | None = DEFAULT_MAX_CULPRIT_SEARCH_STEPS,
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
        self.max_culprit_search_steps = validate.check_optional_int(
            "max_culprit_search_steps", max_culprit_search_steps, minimum=1
        )
        self._decide = decide or rank0_decides
        self._agree = agree or agree_across_ranks
        self._context = context or contextlib.nullcontext
        self._outcomes = Outcomes(self.on_fail, self.max_reports, self.verbose, sinks, on_report)
        self._lessons = Lessons(self.settings)  # what the checks taught the next ones
        self._model: nn.Module | None = None  # the model of the last call, whose windows record() fingerprints
        self._clock = OverheadClock()  # the one clock of both kinds' budget
        self._recomputed = Cadence("recomputed", self.every_n_steps, self.first_check_step, self.max_overhead,
                                   self._clock, keys=RECOMPUTED_KEYS, verbose=self.verbose)  # fmt: skip
        self._applied = Cadence("applied", self.applied_every_n_steps, self.first_check_step, self.max_overhead,
                                self._clock, keys=APPLIED_KEYS)  # fmt: skip
        self._windows = Windows(self._applied)
        self._findings = Findings()  # what the applied checks found: faults, the verified gradient for clipping
        self._updates = UpdateChecks(self._outcomes, self._lessons, self._clock, self._applied)
        self._last_step = 0  # the last optimizer step a call named: record() keeps windows for the one after it
        self._split_models: dict[int, bool] = {}  # by model: whether its ranks hold other parameters (a split by hand)
        self._said: set[str] = set()  # what the watch says once per run (a gradient it cannot read)

    # the reports

    @property
    def reports(self) -> list[CheckReport]:
        """This run's reports of both kinds (``report.scope``), oldest first (at most ``max_reports``)."""
        return list(self._outcomes.reports)

    @property
    def recomputed_reports(self) -> list[CheckReport]:
        """This run's reports with ``scope == "recomputed"``, oldest first."""
        return [report for report in self._outcomes.reports if report.scope == "recomputed"]

    @property
    def applied_reports(self) -> list[CheckReport]:
        """This run's reports with ``scope == "applied"``, oldest first."""
        return [report for report in self._outcomes.reports if report.scope == "applied"]

    @property
    def update_reports(self) -> list[CheckReport]:
        """This run's reports with ``scope == "update"``, oldest first."""
        return [report for report in self._outcomes.reports if report.scope == "update"]

    @property
    def notes(self) -> list[Note]:
        """What the watch's own calls outside a check could not do (code ``watch-error``), one note per call site."""
        return list(self._outcomes.guard.notes)

    # the state

    @property
    def counts(self) -> dict[str, int]:
        """Checks run, failed, skipped, postponed (over budget), applied and update checks run and failed (resumed)."""
        return {**self._outcomes.counts, "postponed": self._recomputed.postponed}

    @property
    def overhead(self) -> float:
        """gradwatch's time so far as a fraction of the training time (measured between calls)."""
        return self._clock.fraction

    @property
    def should_stop(self) -> bool:
        """``True`` once a check failed under ``on_fail="stop"``: the loop should stop (set it back to go on)."""
        return self._outcomes.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._outcomes.should_stop = bool(value)

    @property
    def sinks(self) -> tuple[Sink, ...]:
        """Where the records of every check go (an adapter may set them once its loop's loggers exist)."""
        return self._outcomes.sinks

    @sinks.setter
    def sinks(self, sinks: Sequence[Sink]) -> None:
        self._outcomes.sinks = tuple(sinks)

    @property
    def recording(self) -> bool:
        """Whether the window being run is kept for an applied check at its optimizer step."""
        return bool(self._windows.windows)

    def due(self, previous_step: int, step: int) -> bool:
        """Whether a recomputed check is due after the optimizer steps ``previous_step < s <= step``.

        Args:
            previous_step: The last optimizer step already considered.
            step: The optimizer step just taken.
        """
        with self.guarded("watch.due"):
            return self._recomputed.due(previous_step, step)
        return False

    def due_next(self, step: int) -> bool:  # a recomputed check, e.g. to read a grad scaler's scale before it
        """Whether a recomputed check is (or stays) due at the optimizer step after ``step``.

        Args:
            step: The optimizer step just taken.
        """
        try:  # at every step of some loops: a guard by try/except (see absorbs)
            return self._recomputed.pending or self._recomputed.due(self._recomputed.last_step, step + 1)
        except Exception as error:
            if not self.absorbs("watch.due_next", error):
                raise
        return False

    def state_dict(self) -> dict[str, Any]:
        """The state a checkpoint carries over (plain values: ``torch.load(weights_only=True)`` reads it); only the
        version when it cannot be read (said once, see :meth:`guarded`)."""
        with self.guarded("watch.state_dict"):
            return {
                "version": _STATE_VERSION,
                **self._outcomes.state_dict(),
                "focus": list(self._lessons.focus),
                **self._recomputed.state_dict(),
                **self._clock.state_dict(),
                **self._applied.state_dict(),
                **self._lessons.search_state(),
            }
        return {"version": _STATE_VERSION}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (keys missing from an older version take their defaults).

        Args:
            state_dict: What :meth:`state_dict` returned.
        """
        with self.guarded("watch.load_state_dict"):
            self._outcomes.load_state_dict(state_dict)
            self._lessons.focus = tuple(str(name) for name in state_dict.get("focus", ()))
            self._recomputed.load_state_dict(state_dict)
            self._clock.load_state_dict(state_dict)
            self._applied.load_state_dict(state_dict)
            self._lessons.load_search_state(state_dict)
            self._last_step = int(state_dict.get("last_step", 0))

    # the calls

    def guarded(self, site: str) -> contextlib.AbstractContextManager[None]:
        """A context for what a watch or its adapter runs outside a check (``site`` names it): an error there is one
        note (:attr:`notes`) and one warning, once per site, and the block is left; training goes on (see
        :mod:`gradwatch.watch.guard`).

        Args:
            site: The call site, as the note and the warning name it (``"watch.record"``, ...).
        """
        return self._outcomes.guard(site)

    def absorbs(self, site: str, error: BaseException) -> bool:
        """Whether :meth:`guarded` takes ``error`` raised in ``site`` (a note and a warning once) rather than let it
        through: for a call of every training step, guarded by ``try``/``except``, which costs nothing unless raised.

        Args:
            site: The call site, as for :meth:`guarded`.
            error: What the call raised.
        """
        return self._outcomes.guard.absorbs(site, error)

    def setup(self, model: nn.Module) -> None:
        """Match the ``ignore`` patterns to the model's parameter names (each that matches none warns once); the first
        check does it if not done before.

        Args:
            model: The model the checks will see.
        """
        self._model = model = unwrapped(model)
        with self.guarded("watch.setup"):
            self._lessons.set_up(model)

    def start(self, step: int = 0) -> None:
        """Training (re)starts: the time until the next call is not training time.

        Args:
            step: The optimizer steps already taken (0 for a new run; a resumed run's step).
        """
        with self.guarded("watch.start"):
            self._clock.restart()  # time before the first batch (set-up, a resumed run's restart) is not training time
            self._recomputed.start(step)
            self._last_step = step

    def record(
        self,
        batch: Any,
        *,
        model: nn.Module | None = None,
        step: int | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        """Call before each micro-batch's forward: when the window is due for an applied check, keep a reference to
        ``batch`` (as the ``loss_fn`` of :meth:`before_optimizer_step` takes it) and the random state its forward is
        about to draw from; else nothing.

        Args:
            batch: The micro-batch, never copied: a loop must not change it in place before the optimizer step.
            model: The model (by default the one of the last call): at a window's first micro-batch its ``.grad``
                is fingerprinted, so that gradients left over from the last window are recognised.
            step: The optimizer step this window leads to (by default the one after the last step a call named; with
                several optimizers, the same for each of the step).
            optimizer: With several optimizers, each of its own loss (a GAN), the optimizer whose loss's forward is
                about to run: the window recorded for that optimizer's :meth:`before_optimizer_step` (its own random
                states). Without it, the window is shared by every optimizer of the step.
        """
        if self._updates.pending is not None:
            self._updates.release()
        if self._applied.every_n_steps is None:
            return
        step = self._last_step + 1 if step is None else validate.check_int("step", step, minimum=1)
        key = None if optimizer is None else optimizer_argument("optimizer", optimizer)
        try:  # its float64 checksums of the gradients may run out of memory
            if self._windows.begin(step, self._decide):  # else nothing to keep: the window is not due
                self._windows.record(batch, unwrapped(model) if model is not None else self._model, key)
        except Exception as error:
            if not self.absorbs("watch.record", error):
                raise
            self._windows.abandon()

    def before_optimizer_step(
        self,
        model: nn.Module,
        loss_fn: LossFn | None = None,
        *,
        step: int,
        combine: Combine = "mean",
        path: PathContext | None = None,
        group: Any = "auto",
        loss_scale: float = 1.0,
        gradients: Mapping[str, torch.Tensor] | None = None,
        skipped: bool | Callable[[], bool] = False,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        join: Join | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        window_normalised: bool | Callable[[], bool] = False,
        max_norm: float | None = None,
        training: TrainingPath | None = None,
    ) -> CheckReport | None:
        """Call after the window's backward passes (and any reduction or unscaling), before clipping and
        ``optimizer.step()``: the applied check of the recorded window when one is due, else ``None``. When it
        verified the gradient, the update the optimizer then makes of it is checked too, from a step post hook
        (``check_update=True``, the default; :mod:`gradwatch.watch.updates`): its report joins :attr:`reports`.

        Args:
            model: The module whose ``.grad`` the optimizer applies, or a DeepSpeed engine (``deepspeed.initialize``'s
                first result, ZeRO stages 1-3, called at its accumulation boundary before ``engine.step()``): the
                module it wraps is checked against the engine's full gradients (``FullGradients(engine)``, read only
                when a check is due).
            loss_fn: ``loss_fn(model, batch) -> scalar Tensor``, one micro-batch's loss as the loop computes it (the
                constructor's when ``None``).
            step: The optimizer step about to be taken (1 for the first).
            combine: How the loop combines micro-batch losses: ``"mean"``, ``"sum"`` or ``combine(losses)``.
            path: A factory of the context the training's forward ran in (autocast).
            group: The process group whose ranks check together (DDP); ``"auto"``: the default group when one is
                initialised and the parameters are not sharded, else none.
            loss_scale: A float16 loop's loss scale (``GradScaler.get_scale()``).
            gradients: By parameter name, the gradients to check instead of each ``.grad`` (an engine that keeps
                them elsewhere).
            skipped: Whether the optimizer skips this step (a grad scaler that found non-finite gradients), or a
                function that says so: the due check moves to the next window.
            optimizers: The loop's optimizers, whose state the check puts back if the loss changes it.
            join: ``join(items) -> item``: the recorded micro-batch items as one item of all their samples, for the
                comparison of the accumulated gradient with the window's samples taken as one batch (by default
                :func:`~gradwatch.engine.applied.equivalence.concatenate`).
            optimizer: With several optimizers (a GAN), the one about to step: only the parameters it updates are
                checked, against ``loss_fn``, which must be the loss whose backward made that optimizer's gradient
                (the discriminator's loss for the discriminator's optimizer); the window is the one :meth:`record`
                kept for this optimizer, else the one the step's optimizers share. Call once per optimizer step.
            window_normalised: Each micro-batch's loss is already divided by the whole window's count of samples or
                tokens (or a function that says so): a window gradient that is the one-batch gradient divided by the
                number of micro-batches is then warned of as a second normalisation (see
                :func:`~gradwatch.engine.applied.check_applied_gradient`).
            max_norm: The norm the loop clips the gradient to before the step (``clip_grad_norm_``'s), if it clips:
                the update check's gradient is the verified one clipped so (an ``after_clipping`` call of the step
                declares it too).
            training: ``combine``, ``path``, ``join`` and ``window_normalised`` as one
                :class:`~gradwatch.watch.hooks.TrainingPath` (an adapter's), instead of one by one.

        A check that finds no gradient to read (no ``.grad`` on any checked parameter, none given) says so once, as a
        :class:`~gradwatch.GradientCheckWarning` naming the remedy; its report is inconclusive.
        """
        if type(step) is not int or step < 1:  # asked at every step: the usual case cheaply
            validate.check_int("step", step, minimum=1)
        if optimizer is not None:  # an optimizer that updates none of the model's parameters is the caller's error
            updated_parameters(unwrapped(model), optimizer_argument("optimizer", optimizer))
        if max_norm is not None and (isinstance(max_norm, bool) or not isinstance(max_norm, (int, float))
                                     or not max_norm > 0):  # fmt: skip
            raise ValueError(f"`max_norm` must be a positive number or None; got {max_norm!r}")
        plain = (combine, path, join, window_normalised) == ("mean", None, None, False)
        if training is not None and not plain:
            raise ValueError("give `training` or `combine`, `path`, `join` and `window_normalised`, not both")
        # the defaults' one object, not a new one at every step
        training = training or (_PLAIN_PATH if plain else TrainingPath(combine, path, join, window_normalised))
        try:
            if optimizer is None and self._updates.pending is None and self._windows.idle(step):
                # no window kept for this step, none due after it: the step's bookkeeping alone, as _window() does it
                self._model = model if model is self._model else unwrapped(model)  # never an engine itself
                self._last_step = max(self._last_step, step)
                if self._applied.every_n_steps is not None:
                    self._clock.batch_ended(time.perf_counter())
                return None
            if is_engine(model):  # DeepSpeed: the gradient lives in the engine's partitions
                model, gradients = unwrapped(model), FullGradients(model) if gradients is None else gradients
            earlier = self._windows.earlier(step, optimizer)  # other optimizers' updates since its loss ran
            window = self._window(model, step, optimizer, optimizers, skipped)
            if window is None:
                return None
            return self._applied_check(
                window, model, loss_fn, step=step, training=training, group=group, loss_scale=loss_scale,
                gradients=gradients, optimizers=optimizers, optimizer=optimizer, max_norm=max_norm, earlier=earlier,
            )  # fmt: skip
        except Exception as error:
            if not self.absorbs("watch.before_optimizer_step", error):
                raise
        return None

    def after_clipping(
        self,
        model: nn.Module,
        max_norm: float,
        *,
        step: int,
        clipped_with: float | Callable[[], float | None] | None = None,
    ) -> CheckReport | None:
        """Call after the loop clipped the gradient by its norm (``clip_grad_norm_``, ``gradient_clip_val``,
        ``max_grad_norm``), before ``zero_grad``: when an applied check verified this step's gradient, check that the
        gradient the optimizer steps with is the verified one times ``min(1, max_norm / ‖g‖)`` with ``‖g‖`` its true
        global norm (over ranks and shards); a wrong coefficient fails with ``fault == "clipping"`` and both norms in
        the message (:func:`gradwatch.engine.applied.clipping.check_clipping`). Else ``None``.

        Args:
            model: The model whose gradient was clipped, or the DeepSpeed engine that clipped it (after
                ``engine.step()``: the norm it clipped with is read from it unless ``clipped_with`` is given).
            max_norm: The clipping threshold (``clip_grad_norm_``'s ``max_norm``).
            step: The optimizer step, the one :meth:`before_optimizer_step` was given.
            clipped_with: For an engine that clips the gradient in its own partitions, out of ``.grad`` (DeepSpeed,
                after ``engine.step()``: ``engine.get_global_grad_norm()``), the norm it clipped with, checked against
                the verified gradient's (:func:`~gradwatch.engine.applied.clipping.check_clip_norm`), or a function
                that reads it, called only when a check verified this step's gradient (reading it may wait for the
                device; ``None`` from it: nothing to check); without it such a gradient (checked with ``gradients=``)
                is not checked here, which is said once.
        """
        if is_engine(model) and clipped_with is None:
            engine = model
            model, clipped_with = unwrapped(engine), lambda: clipped_norm(engine)
        try:  # at every step of a loop that clips: a guard by try/except (see absorbs)
            self._updates.declare(step, max_norm)
            verified = self._findings.take_verified(step)
            check = None if verified is None else clip_check(verified, model, max_norm, step, clipped_with,
                                                             say_once=self._say_once)  # fmt: skip
            report = None if check is None else self._outcomes.guarded(step, check, [])
            if report is not None:
                self._outcomes.publish(report, self._overhead())
            return report
        except Exception as error:
            if not self.absorbs("watch.after_clipping", error):
                raise
        return None

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer | None = None, *, step: int) -> CheckReport | None:
        """Call after ``optimizer.step()`` where the optimizer's step runs no step hooks (the watch's own post hook runs
        the check otherwise, and this call only returns its report): the update check of step ``step`` when one is
        pending, else ``None``.

        Args:
            optimizer: The optimizer that stepped; by default the one the check kept.
            step: The optimizer step just taken (the step of the applied check that verified its gradient).
        """
        return self._updates.stepped(optimizer, step)

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
            model: The module whose trainable floating parameters are checked (a DeepSpeed engine: the module it wraps).
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
        if self._updates.pending is not None:
            self._updates.release()  # the update check's one-shot hooks, once they have run
        loss_fn = self._loss_fn(loss_fn, step)
        model = model if model is self._model else unwrapped(model)  # the model of the last call: never an engine
        self._model, self._last_step = model, max(self._last_step, step)
        try:
            self._clock.batch_ended(now)
            if not self._recomputed.reached(step):
                return None
            if skipped() if callable(skipped) else skipped:
                # the check stays pending and runs at the next optimizer step
                self._outcomes.counts["skipped"] += 1
                if self.verbose:
                    log.info("gradwatch: the grad scaler skipped step %d; the check moves to the next step", step)
                return None
            if not self._recomputed.runs_now(step, self._decide):
                return None
            return self._run(model, batch, loss_fn, step, now, tuple(optimizers))
        except Exception as error:
            if not self.absorbs("watch.maybe_check", error):
                raise
        return None

    def check(
        self, model: nn.Module, batch: Any, loss_fn: LossFn | None = None, *, step: int,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> CheckReport | None:  # fmt: skip
        """Check now, whatever the cadence; recorded, counted and alerted like a scheduled check.

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
            return self._run(unwrapped(model), batch, loss_fn, step, time.perf_counter(), tuple(optimizers))
        return None

    def flush(self) -> None:
        """Flush every sink."""
        for sink in self._outcomes.sinks:
            with self.guarded(f"the sink {type(sink).__name__}"):
                sink.flush()

    # what the calls share

    def _loss_fn(self, loss_fn: LossFn | None, step: int) -> LossFn:
        chosen = loss_fn if loss_fn is not None else self.loss_fn
        if type(step) is int and step >= 0 and callable(chosen):  # at every step: the usual case, asked cheaply
            return chosen
        validate.check_int("step", step, minimum=0)
        chosen = validate.check_optional_callable("loss_fn", chosen)
        if chosen is None:
            raise ValueError("`loss_fn` must be given, to the watch or to this call: gradwatch needs the loss to check")
        return chosen

    def _contexts(self, model: nn.Module, *, local: bool) -> list[contextlib.AbstractContextManager[Any]]:
        """The loop's context around a check, and for a check each process makes alone, SyncBatchNorm local."""
        return [self._context(model), local_batch_norm(model) if local else contextlib.nullcontext()]

    def _overhead(self) -> Any:
        return self._clock.reading(self._recomputed.steps)

    def _search_budget(self) -> SearchBudget:
        return self._lessons.search_budget(self.max_culprit_search_steps, self._overhead().step_seconds)

    def _say_once(self, what: str, text: str) -> None:
        if what not in self._said:
            self._said.add(what)
            warnings.warn(text, GradientCheckWarning, stacklevel=4)

    # the recomputed check

    def _run(
        self, model: nn.Module, batch: Any, loss_fn: LossFn, step: int, started: float,
        optimizers: tuple[torch.optim.Optimizer, ...],
    ) -> CheckReport | None:  # fmt: skip
        if not self._lessons.checkable(model):
            self._outcomes.counts["skipped"] += 1
            return None
        self._lessons.set_up(model, force=False)
        lessons = self._lessons
        check = lambda: check_gradients(  # noqa: E731
            model, batch, loss_fn, step=step, settings=lessons.active, rotation=self._outcomes.counts["checks"],
            focus=lessons.focus, optimizers=optimizers, search_budget=self._search_budget(),
        )  # fmt: skip
        if self._split(model):  # every rank's part against the ranks' summed loss, every rank together
            check = lambda: split_check(  # noqa: E731
                model, batch, loss_fn, group=default_group(model), step=step, settings=lessons.active,
                optimizers=optimizers,
            )  # fmt: skip
        report = self._outcomes.agreed(step, check, self._contexts(model, local=True), self._agree)
        with self.guarded("the budget's clock"):
            ended = time.perf_counter()
            self._clock.check_ran(started, ended)
            self._recomputed.ran(ended - started)
        if report is not None:
            with self.guarded("the lessons of a check"):
                self._lessons.learn(report)
            self._outcomes.publish(report, self._overhead())
        return report

    def _split(self, model: nn.Module) -> bool:
        """Whether the ranks hold other parameters than rank 0 (a model split by hand), asked once per model on every
        rank together before its first recomputed check (:mod:`gradwatch.engine.applied.split`)."""
        if id(model) not in self._split_models:
            self._split_models[id(model)] = bool(split_ranks(model))
        return self._split_models[id(model)]

    # the applied check

    def _window(
        self, model: nn.Module, step: int, optimizer: Any, optimizers: Sequence[torch.optim.Optimizer],
        skipped: bool | Callable[[], bool],
    ) -> AppliedWindow | None:  # fmt: skip
        """The window recorded for the applied check due at ``step`` (once the step's bookkeeping is done), else
        ``None``: none due, none recorded (said once), or the optimizer skips the step."""
        self._updates.release(step)
        if self.check_update and self._windows.due(step + 1, step):
            self._updates.keep_previous(model, step, optimizer, optimizers, updated_parameters(model, optimizer))
        self._model, self._last_step = model, max(self._last_step, step)
        if self._applied.enabled:  # a loop that makes only applied checks measures its training time here
            self._clock.batch_ended(time.perf_counter())
        window = self._windows.take(step, optimizer)
        if optimizer is not None:  # its update moves parameters that windows recorded before it are checked before
            self._windows.stepping(step, model, optimizer)
        if window is None and self._windows.unrecorded(step):
            warnings.warn(
                f"gradwatch: the applied check due at optimizer step {step} has no recorded window: no applied check "
                "runs until watch.record(batch) is called before each micro-batch's forward, with the step "
                "before_optimizer_step is then given (said once)",
                GradientCheckWarning,
                stacklevel=4,
            )
        if window is None or not self._lessons.checkable(model):
            return None
        if skipped() if callable(skipped) else skipped:
            self._applied.owe()
            if self.verbose:
                log.info("gradwatch: the optimizer skips step %d; the applied check moves to the next window", step)
            return None
        return window

    def _applied_check(
        self, window: AppliedWindow, model: nn.Module, loss_fn: LossFn | None, *, step: int, training: TrainingPath,
        group: Any, loss_scale: float, gradients: Mapping[str, torch.Tensor] | None,
        optimizers: Sequence[torch.optim.Optimizer], optimizer: Any, max_norm: float | None, earlier: Earlier,
    ) -> CheckReport | None:  # fmt: skip
        """The applied check of ``window`` along the loop's ``training`` path (its loss at the parameters before the
        ``earlier`` updates), and what it leaves for the clip and update checks."""
        guard = self._outcomes.guard
        loss_fn = guard.callers(self._loss_fn, loss_fn, step)  # bad arguments are the caller's errors
        loss_fn = rewound(loss_fn, model, earlier) if earlier else loss_fn
        updated, own = guard.callers(updated_parameters, model, optimizer), gradients is None
        if updated is not None:  # the optimizer's own parameters, their gradients (or those given) alone
            given = gradients if gradients is not None else {name: p.grad for name, p in updated if p.grad is not None}
            only = {name for name, _ in updated}
            gradients = {name: g for name, g in given.items() if name in only}
            if not {name for name, _ in checked_parameters(model, self._lessons.active.ignore)} & set(gradients):
                return None  # nothing this optimizer applies is checked here (ignore=: another watch's optimizer)
            optimizers = (*optimizers, optimizer) if all(o is not optimizer for o in optimizers) else optimizers
        if not self._readable(model, gradients):
            self._say_once("gradient", UNREAD_GRADIENT.format(step=step))
        group = default_group(model) if group == "auto" else group
        started = time.perf_counter()
        window.last_fault = self._findings.faults.get(id(optimizer))  # a fault found again is no one-off
        budget = self._search_budget()
        check = lambda: window.check(  # noqa: E731
            loss_fn, model, step=step, group=group, loss_scale=loss_scale, gradients=gradients,
            optimizers=tuple(optimizers), rotation=self._applied.checks, settings=self._lessons.active,
            search_budget=budget, closer_look=not self._applied.unbounded, **vars(training),
            float64_probes=self._lessons.float64.allows(model),  # not tried again in vain once it ran out of memory
        )  # fmt: skip
        # ranks that check together keep SyncBatchNorm's statistics over every rank, the training's function
        local = group is None and not is_sharded(list(model.named_parameters()))
        try:
            report = self._outcomes.guarded(step, check, self._contexts(model, local=local))
        finally:
            seconds = time.perf_counter() - started
            self._clock.add_check(seconds)
            self._applied.ran(seconds)
            self._lessons.learn_step(budget)
        if report is None:
            return None
        if deferred(report.notes):  # its closer look is owed: a full check as soon as the budget affords one
            self._applied.owe()
        self._findings.faults[id(optimizer)] = (step, report.fault)
        self._lessons.learn_applied(report)
        self._outcomes.publish(report, self._overhead())
        # what clipping must keep of the verified gradient: its norms (a few numbers, no copy); for gradients an
        # engine keeps elsewhere (it clips them itself, out of .grad) only their global norm is of use
        with self.guarded("the clip check's norms of the verified gradient"):
            held = gradients_of(model, updated) if own else list((gradients or {}).values())
            self._findings.verified = Verified(step, GradientNorms.of(held), own)
        # not checked: the update of gradients an engine keeps elsewhere (but ZeRO's) or still scaled (float16)
        engine = zero_engine(gradients)
        if (own or engine) and loss_scale == 1.0 and self.check_update and self._findings.verified is not None:
            with self.guarded("the update check's copies before the step"):
                self._updates.prepare(model, step, optimizer, optimizers, updated, max_norm=max_norm, engine=engine,
                                      norm=self._findings.verified.norms.total, gradients=gradients)  # fmt: skip
        return report

    def _readable(self, model: nn.Module, gradients: Mapping[str, torch.Tensor] | None) -> bool:
        """Whether any checked parameter has a gradient to check: its ``.grad``, or one of ``gradients``."""
        checked = checked_parameters(model, self._lessons.active.ignore)
        if gradients is None:
            return any(p.grad is not None for _, p in checked)
        return any(gradients.get(name) is not None for name, _ in checked)


_PLAIN_PATH = TrainingPath()
"""A plain loop's training path (each micro-batch's loss divided by their count, its forward as it is)."""
