"""``GradWatch``: the Lightning callback that checks gradients from time to time while a run trains.

It only turns Lightning hooks into calls of :func:`gradwatch.engine.check_gradients` and sends the reports to the
trainer's loggers (:mod:`gradwatch.tensorboard` for what only TensorBoard shows) and to the alert policy
(:mod:`.alerts`); the numerics live in the engine, the loss a check evaluates in :mod:`.training_step`.
"""

from __future__ import annotations

import fnmatch
import logging
import time
import warnings
from collections import deque
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from gradwatch.engine import CheckReport, LossFn, check_gradients
from gradwatch.engine import validation as validate
from gradwatch.engine.function.precision import PRECISIONS, Precision
from gradwatch.engine.report import UnrestoredStateWarning
from gradwatch.engine.selection import unmatched_patterns
from gradwatch.lightning.alerts import ON_FAIL_CHOICES, AlertPolicy, Backoff, GradientCheckWarning, OnFail, Remarks
from gradwatch.lightning.distributed import agree, distributed
from gradwatch.lightning.publishing import (
    publish,
    publish_dashboard,
    show_in_progress_bar,
)
from gradwatch.lightning.schedule import Schedule
from gradwatch.lightning.training_step import (
    NoLossToCheckError,
    local_batch_norm,
    loggers_silenced,
    training_step_loss,
)

log = logging.getLogger(__name__)

_STATE_VERSION = 1

DEFAULT_EVERY_N_STEPS = 500
"""The cadence of ``GradWatch()``: a check every this many optimizer steps (besides the first, at step 1)."""

DEFAULT_PROBE_BATCH_SIZE = 2
"""The samples a check probes by default: two, so that code that mixes the samples of a batch (a backward that
averages over the whole batch instead of each sample, a ``.squeeze()`` that drops the batch dimension of one sample)
is checked as it runs in training; one sample hides such bugs."""

DEFAULT_MAX_OVERHEAD = 0.01
"""The budget of ``GradWatch()``: checks take at most this fraction of the training time, so that the default cadence
holds on models whose check costs many training steps (a ResNet-18 on a CPU: about 8 steps per check)."""


def _grad_scaler(trainer: pl.Trainer) -> Any:
    """The precision plugin's ``GradScaler`` (``precision="16-mixed"``), or ``None``."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if scaler is not None and hasattr(scaler, "get_scale") else None


class GradWatch(Callback):
    r"""Check, every so often during training, that the gradients autograd computes are the derivatives of the loss.

    At the chosen optimizer steps, gradwatch re-evaluates the loss of the current batch with small perturbations of
    sampled parameters and inputs (finite differences), and compares with autograd's gradient of the same loss,
    computed separately so the training's ``.grad`` is never touched. Random states, buffers, parameters and ``.grad``
    are restored exactly afterwards: training continues as if nothing happened. Results go to the trainer's loggers
    (see the README for the tags) and to :attr:`reports`; failures raise an alert.

    Args:
        every_n_steps: Check every this many optimizer steps; by default every :data:`DEFAULT_EVERY_N_STEPS`, within
            the budget of ``max_overhead``.
        first_check_step: Also check at this optimizer step, so a wrong gradient surfaces in the first minutes of a
            run; ``None`` to rely on ``every_n_steps`` alone.
        on_fail: ``"warn"`` (a :class:`~gradwatch.lightning.alerts.GradientCheckWarning` and a log record naming the
            tensor and index, rate-limited), ``"raise"`` (:class:`~gradwatch.GradientCheckError`), ``"stop"`` (warn and
            stop the trainer cleanly) or a callable receiving the failing :class:`~gradwatch.CheckReport`.
        loss_fn: ``loss_fn(module, batch) -> scalar Tensor`` to check instead of the module's ``training_step``.
            Required for modules with manual optimization, whose ``training_step`` steps the optimizers.
        probe_batch_size: Probe the loss of the first this many samples of the batch (``None``: the whole batch).
            Every loss evaluation of a check costs a forward pass on that slice, so a small slice keeps checks cheap;
            the function checked is the loss of the slice, so verdicts stay exact. Two samples by default
            (:data:`DEFAULT_PROBE_BATCH_SIZE`: one would hide bugs that mix the samples of a batch); a loss that
            refuses the slice is probed on four, else on the whole batch.
        max_overhead: The budget: a due check is postponed while gradwatch's time, with that check, would exceed
            this fraction of the training time; the first check is always made, and measures the cost. ``"auto"``
            (the default): :data:`DEFAULT_MAX_OVERHEAD` (1%) when ``every_n_steps`` is left at its default, so that
            ``GradWatch()`` costs at most 1% whatever the model costs to check; no budget when you choose a cadence
            yourself (``every_n_steps=1`` while debugging checks every step). ``None``: no budget. Combine a fraction
            with a small ``every_n_steps`` to check as often as the budget allows. Under DDP, rank 0 decides for
            every rank.
        precision: ``"native"``, ``"float64"`` or ``"auto"`` (float64 up to 2**25 parameter elements); see
            :func:`gradwatch.check_gradients`.
        vectorize: Evaluate the points of float64 probes together, in few forward passes (see
            :mod:`gradwatch.engine.measuring.vectorized`). A loss that cannot be vectorised (a custom
            ``autograd.Function`` without a vmap rule, say) is evaluated point by point, and after the first such check
            the callback stops trying.
        fail_on_imprecise: Fail a float32 gradient whose formula is right but whose rounding exceeds ``rtol`` (reason
            ``"imprecise"``, ``ok`` by default); see :func:`gradwatch.check_gradients`.
        ignore: ``fnmatch`` patterns of parameter names not to check (e.g. straight-through estimators).
        tensor_probes: Tensors probed along their own gradient per check (in turn; all of them after a failure).
        random_probes: Tensors probed along a random direction per check (in turn).
        param_probes: Coordinate probes on parameters per check, spread over the tensors in turn.
        input_probes: Probes on the floating tensors of the batch per check: the first along the inputs' gradient,
            the others at single coordinates (``0`` for no input probe at all).
        rtol: Relative tolerance of a probe; ``None`` picks it from the parameters' dtype.
        seed: Seed of the coordinate sampling (combined with the step, so every process probes the same coordinates).
        max_reports: How many reports :attr:`reports` keeps (the oldest are dropped).

    Raises:
        ValueError: An argument is out of range or of the wrong type (at construction), or the module uses manual
            optimization and no ``loss_fn`` was given (at ``setup``).

    Example::

        trainer = Trainer(callbacks=[GradWatch()])
        trainer.fit(model, datamodule)
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
    ) -> None:
        super().__init__()
        chosen = validate.check_optional_int("every_n_steps", every_n_steps, minimum=1)
        self.every_n_steps = DEFAULT_EVERY_N_STEPS if chosen is None else chosen
        self.first_check_step = validate.check_optional_int("first_check_step", first_check_step, minimum=1)
        self.on_fail = validate.check_choice("on_fail", on_fail, ON_FAIL_CHOICES, allow_callable=True)
        self.loss_fn = validate.check_optional_callable("loss_fn", loss_fn)
        self.probe_batch_size = validate.check_optional_int("probe_batch_size", probe_batch_size, minimum=1)
        self._probe_samples = self.probe_batch_size
        if max_overhead == "auto":
            self.max_overhead = DEFAULT_MAX_OVERHEAD if chosen is None else None
        else:
            self.max_overhead = validate.check_fraction("max_overhead", max_overhead, optional=True, auto=True)
        self.precision = validate.check_choice("precision", precision, PRECISIONS)
        self.vectorize = validate.check_bool("vectorize", vectorize)
        self._vectorize = self.vectorize  # off once a check found the loss cannot be vectorised
        self.fail_on_imprecise = validate.check_bool("fail_on_imprecise", fail_on_imprecise)
        self.ignore = validate.check_patterns("ignore", ignore)
        self._ignore = self.ignore  # those of the patterns that match a parameter of the module (see setup)
        self.tensor_probes = validate.check_int("tensor_probes", tensor_probes, minimum=0)
        self.random_probes = validate.check_int("random_probes", random_probes, minimum=0)
        self.param_probes = validate.check_int("param_probes", param_probes, minimum=0)
        self.input_probes = validate.check_int("input_probes", input_probes, minimum=0)
        self.rtol = validate.check_fraction("rtol", rtol, optional=True)
        self.seed = validate.check_int("seed", seed, minimum=0)
        self.max_reports = validate.check_int("max_reports", max_reports, minimum=1)
        self._reports: deque[CheckReport] = deque(maxlen=self.max_reports)
        self._alerts = AlertPolicy(self.on_fail)
        self._checks = 0
        self._failed_checks = 0
        self._skipped_checks = 0
        self._focus: tuple[str, ...] = ()  # tensors the last check could not decide: the next check probes them again
        self._schedule = Schedule(self.every_n_steps, self.first_check_step, self.max_overhead)
        self._scale_before: float | None = None  # the GradScaler's scale before a due optimizer step
        self._warned_no_params = False
        self._remarks = Remarks()

    @property
    def reports(self) -> list[CheckReport]:
        """The reports of this run's checks, oldest first (at most ``max_reports``)."""
        return list(self._reports)

    @property
    def state_key(self) -> str:
        # Two GradWatch callbacks that check different losses (one per optimizer of a GAN) need keys of their own;
        # a callback with neither keeps the key it always had, so its checkpoints still load.
        distinct: dict[str, Any] = {}
        if self.loss_fn is not None:
            distinct["loss_fn"] = getattr(self.loss_fn, "__qualname__", type(self.loss_fn).__qualname__)
        if self.ignore:
            distinct["ignore"] = list(self.ignore)
        return self._generate_state_key(every_n_steps=self.every_n_steps, seed=self.seed, **distinct)

    def due(self, previous_step: int, step: int) -> bool:
        """Whether a check is due after the optimizer steps ``previous_step < s <= step``."""
        return self._schedule.due(previous_step, step)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not pl_module.automatic_optimization and self.loss_fn is None:
            raise ValueError(
                f"{type(pl_module).__name__} uses manual optimization (automatic_optimization = False): its "
                "training_step steps the optimizers, so gradwatch cannot call it to probe the loss. Pass the loss to "
                "check instead: GradWatch(loss_fn=lambda module, batch: ...)"
            )
        if stage == "fit":
            # said once here, with the module's names; the checks then get only the patterns that match something
            names = [name for name, _ in pl_module.named_parameters()]
            for message in unmatched_patterns(self.ignore, names):
                warnings.warn(f"gradwatch: {message}", GradientCheckWarning, stacklevel=2)
            self._ignore = tuple(p for p in self.ignore if any(fnmatch.fnmatchcase(name, p) for name in names))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._schedule.start(trainer.global_step)  # restored from the checkpoint when resuming
        # a checkpoint's focus may name parameters this module no longer has (a renamed layer): they are left out
        names = {name for name, _ in pl_module.named_parameters()}
        self._focus = tuple(name for name in self._focus if name in names)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Under 16-mixed the GradScaler skips optimizer steps with non-finite gradients and lowers its scale; the
        # scale is read (a device sync) only before a step that is due for a check.
        scaler = _grad_scaler(trainer)
        if scaler is not None and self._scale_before is None and self._schedule.due_next(trainer.global_step):
            self._scale_before = scaler.get_scale()

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        now = time.perf_counter()
        # global_step counts optimizer steps: it does not move on the micro-batches of gradient accumulation
        step = trainer.global_step
        scale_before, self._scale_before = self._scale_before, None
        if not self._schedule.step_ended(step, now):
            return
        scaler = _grad_scaler(trainer)
        if scale_before is not None and scaler is not None and scaler.get_scale() < scale_before:
            # The scaler skipped the optimizer step (non-finite scaled gradients): count the check as skipped; it stays
            # pending and runs at the next optimizer step.
            self._skipped_checks += 1
            log.info("gradwatch: the grad scaler skipped optimizer step %d; the check moves to the next step", step)
            return
        if not self._schedule.runs_now(step, lambda wait: self._decide(trainer, step, wait)):
            return
        try:
            report = self._check(pl_module, batch, batch_idx, step)
        except Exception as error:
            # on_fail="raise" (or a check that could not run under it): under DDP every process must learn of it
            # before any raises, or the others would wait for it forever
            if not distributed(trainer):
                raise
            agree(trainer, None, error)
            raise
        if distributed(trainer):
            report = agree(trainer, report, None)
        self._schedule.ran(now, time.perf_counter())
        if report is None:
            return
        self._record(report)
        publish(trainer, report, self.overhead)
        show_in_progress_bar(trainer, report, self._failed_checks)
        if self._alerts.handle(report):
            trainer.should_stop = True

    @property
    def overhead(self) -> float:
        """gradwatch's time so far as a fraction of the training time (measured between training batches)."""
        return self._schedule.clock.fraction

    def _decide(self, trainer: pl.Trainer, step: int, wait: int) -> int:
        """Rank 0's budget decision for every rank (ranks measure different times): 0 to check now, else the steps
        the due check waits."""
        wait = int(trainer.strategy.broadcast(wait, src=0))
        if wait and not self._schedule.postponed:
            log.info(
                "gradwatch: the check due at step %d is postponed by %d steps, so that checks cost at most %g of the "
                "training time (max_overhead); GradWatch(max_overhead=None) checks on schedule",
                step,
                wait,
                self.max_overhead,
            )
        return wait

    def _check(self, pl_module: pl.LightningModule, batch: Any, batch_idx: int, step: int) -> CheckReport | None:
        if not any(p.requires_grad and p.is_floating_point() for p in pl_module.parameters()):
            self._skipped_checks += 1
            if not self._warned_no_params:
                self._warned_no_params = True
                warnings.warn(
                    f"gradwatch: {type(pl_module).__name__} has no trainable floating-point parameter (layers kept in "
                    "a plain list or dict are not registered); its checks are skipped",
                    GradientCheckWarning,
                    stacklevel=2,
                )
            return None
        loss_fn = self.loss_fn or training_step_loss(pl_module, batch_idx)
        try:
            with local_batch_norm(pl_module), loggers_silenced(pl_module.trainer), warnings.catch_warnings():
                # what a check could not put back is warned of once per run, by the remarks
                warnings.simplefilter("ignore", UnrestoredStateWarning)
                return check_gradients(
                    pl_module,
                    batch,
                    loss_fn,
                    step=step,
                    tensor_probes=self.tensor_probes,
                    random_probes=self.random_probes,
                    param_probes=self.param_probes,
                    input_probes=self.input_probes,
                    probe_batch_size=self._probe_samples,
                    precision=self.precision,
                    vectorize=self._vectorize,
                    fail_on_imprecise=self.fail_on_imprecise,
                    ignore=self._ignore,
                    rtol=self.rtol,
                    seed=self.seed,
                    rotation=self._checks,
                    focus=self._focus,
                    optimizers=pl_module.trainer.optimizers,
                )
        except NoLossToCheckError:
            self._skipped_checks += 1
            log.debug("gradwatch: training_step returned None at step %d; check skipped", step)
        except Exception as error:
            # The one deliberate catch-all: a check must never end a training run (the engine has already restored
            # the model exactly). on_fail="raise" asks for the opposite.
            if self.on_fail == "raise":
                raise
            self._skipped_checks += 1
            self._alerts.check_error(step, error)
        return None

    def _record(self, report: CheckReport) -> None:
        self._reports.append(report)
        self._checks += 1
        if self._probe_samples is not None and report.samples is not None and report.samples > self._probe_samples:
            self._probe_samples = report.samples  # the loss refused the smaller slice: no need to try it again
        self._focus = report.undecided
        if report.vectorized is False:
            self._vectorize = False  # the loss could not be vectorised: the next checks need not try again
        self._failed_checks += report.verdict == "fail"
        self._remarks.hear(report)
        log.debug("gradwatch %s", report.summary())

    @override
    def state_dict(self) -> dict[str, Any]:
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

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._checks = int(state_dict.get("checks", 0))
        self._failed_checks = int(state_dict.get("failed_checks", 0))
        self._skipped_checks = int(state_dict.get("skipped_checks", 0))
        self._focus = tuple(str(name) for name in state_dict.get("focus", ()))
        self._schedule.load_state_dict(state_dict)
        self._alerts = AlertPolicy(
            self.on_fail,
            Backoff(int(state_dict.get("failure_warnings", 0))),
            Backoff(int(state_dict.get("error_warnings", 0))),
        )

    @property
    def counts(self) -> dict[str, int]:
        """Checks run, failed, skipped (an error, or no loss) and postponed (over budget) so far in this run
        (restored on resume)."""
        return {
            "checks": self._checks,
            "failed": self._failed_checks,
            "skipped": self._skipped_checks,
            "postponed": self._schedule.postponed,
        }

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the dashboard's layout goes into each TensorBoard run once, before any check, so it is there from the start
        publish_dashboard(trainer)
