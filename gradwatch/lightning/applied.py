"""Checks of the gradient the optimizer applies, in a Lightning run: :class:`AppliedChecks`, used by ``GradWatch``.

Lightning hooks turned into :func:`gradwatch.engine.applied.check_applied_gradient` calls:

* ``on_train_batch_start``: when the next optimizer step is due for an applied check, keep the micro-batch (a
  reference, not a copy) and the random state its forward is about to draw from (an :class:`AppliedWindow`); nothing
  at all otherwise;
* ``on_before_optimizer_step`` (after accumulation, the cross-rank reduction and the 16-mixed unscale, before
  clipping): check ``.grad`` as it is, on the training's path (the precision plugin's autocast context, the module's
  own ``training_step``, each micro-batch's loss divided by ``accumulate_grad_batches`` and summed). The optimizer then
  steps with the same gradient, bit for bit.

Under DDP every rank runs the check together (the window loss is the mean of the ranks' losses, the ranks' gradients
are compared by checksums); under FSDP2 (``ModelParallelStrategy``) every rank checks its rows of the gradient
FSDP reduce-scattered, together (:mod:`gradwatch.engine.applied.sharded`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from gradwatch.engine import CheckReport, LossFn
from gradwatch.engine.applied import AppliedWindow
from gradwatch.engine.sharding.parameters import is_sharded
from gradwatch.lightning.distributed import distributed
from gradwatch.lightning.overhead import OverheadClock
from gradwatch.lightning.publishing import write_records
from gradwatch.lightning.training_step import (
    NoLossToCheckError,
    local_batch_norm,
    loggers_silenced,
    training_step_loss,
)
from gradwatch.outputs.records import applied_records_of
from gradwatch.outputs.records import applied_scalars as applied_scalars  # re-exported: its former home

log = logging.getLogger(__name__)

DEFAULT_APPLIED_EVERY_N_STEPS = 5000
"""The cadence of applied checks under ``GradWatch()``: every this many optimizer steps (and at the first check step).

An applied check evaluates the loss of the whole accumulation window 14-40 times (a full stencil along the applied
gradient, a screen per probed tensor) and runs 2-4 extra forward and backward passes of the window: measured by
``benchmarks/applied.py`` at 18-56 training steps on its small CPU models (about 25 typically). Every 5000 steps
that is about 0.5% of the training time, half of the 1% budget (``max_overhead``) the applied checks share with the
recomputed ones; the budget postpones what does not fit on models whose checks cost more, so ``GradWatch()`` stays
within 1% with both kinds on. The first check step (step 1 by default) is due for an applied check whatever the
cadence; under a budget it waits until the training time affords it (:data:`FIRST_CHECK_ESTIMATE_STEPS`)."""

FIRST_CHECK_ESTIMATE_STEPS = 25
"""What the first applied check of a run is taken to cost, in training steps, before one has measured it: the typical
cost ``benchmarks/applied.py`` measures on its CPU models (17-44). Under a budget the first applied check waits until
the training time affords that much (about 2,500 steps at 1%), a due check after it until the training time affords
what the last one cost; without a budget it runs when due."""

DEFAULT_APPLIED_TENSOR_PROBES = 6
"""Tensors probed along their own applied gradient per applied check, in turn (all of them once a probe fails)."""


def _grad_scale(trainer: pl.Trainer) -> float:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None and hasattr(scaler, "get_scale") else 1.0


class AppliedChecks:
    """The applied checks of one ``GradWatch``: its cadence, the window being recorded, and the checks.

    Args:
        every_n_steps: Check the applied gradient every this many optimizer steps; ``None``: never.
        first_check_step: Also at this optimizer step (``None``: not).
        loss_fn: The user's ``loss_fn(module, batch)``, or ``None`` for the module's ``training_step``.
        max_overhead: The share of the training time all checks may take (``None``: no budget).
        clock: The clock of gradwatch's time against the training's, shared with the recomputed checks.
        tensor_probes: Tensors probed per check, in turn.
        ignore: Patterns of parameter names not to check (``GradWatch(ignore=...)``).
    """

    def __init__(
        self,
        every_n_steps: int | None,
        first_check_step: int | None,
        loss_fn: LossFn | None,
        max_overhead: float | None,
        clock: OverheadClock,
        tensor_probes: int = DEFAULT_APPLIED_TENSOR_PROBES,
        ignore: tuple[str, ...] = (),
    ) -> None:
        self.ignore = ignore
        self.every_n_steps = every_n_steps
        self.first_check_step = first_check_step
        self.loss_fn = loss_fn
        self.max_overhead = max_overhead
        self.clock = clock
        self.tensor_probes = tensor_probes
        self.window: AppliedWindow | None = None
        self._window_step = -1  # the global_step the recorded window's optimizer step follows
        self._pending = False  # a due check postponed by the budget runs once the budget affords it
        self._resume_at = 0  # a postponed check is not asked about again before this optimizer step
        self._steps_seen = 0  # optimizer steps this process trained (the training time per step: clock / steps)
        self._checks = 0
        self.last_seconds = 0.0
        self._said_unsupported = False
        self.reports: deque[CheckReport] = deque(maxlen=1000)

    def due(self, next_step: int) -> bool:
        """Whether the optimizer step ``next_step`` (1-based, as ``global_step`` counts it after the step) is due."""
        if self.every_n_steps is None:
            return False
        return self._pending or next_step == self.first_check_step or next_step % self.every_n_steps == 0

    def batch_started(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Record the micro-batch if the optimizer step it leads to is due and the budget allows a check costing what
        the last one did (the first: :data:`FIRST_CHECK_ESTIMATE_STEPS` training steps). A postponed check is asked
        about again only at the step the budget was computed to afford it, one decision per postponement."""
        step = trainer.global_step
        if step != self._window_step:  # a new window begins
            self.window = None
            self._steps_seen += self._window_step >= 0
            self._window_step = step
            if self.due(step + 1):
                if step + 1 < self._resume_at:
                    self._pending = True
                    return
                wait = self._wait(trainer)
                if wait:
                    self._pending, self._resume_at = True, step + 1 + wait
                    return
                if self._supported(module):
                    self.window = AppliedWindow(module)
        if self.window is not None:
            self.window.record((batch, batch_idx))

    def _wait(self, trainer: pl.Trainer) -> int:
        """0 when another applied check fits the budget, else the optimizer steps until the training time affords it
        at the mean time per step so far (rank 0 decides for every rank)."""
        budget = self.max_overhead
        if budget is None:
            return 0
        clock = self.clock
        per_step = clock.train_seconds / self._steps_seen if self._steps_seen and clock.train_seconds > 0 else 0.0
        if per_step <= 0:
            wait = 1  # no training time measured yet: ask again at the next step
        else:
            cost = self.last_seconds if self._checks else FIRST_CHECK_ESTIMATE_STEPS * per_step
            needed = (clock.check_seconds + clock.applied_seconds + cost) / budget - clock.train_seconds
            wait = max(0, math.ceil(needed / per_step))
        return int(trainer.strategy.broadcast(wait, src=0)) if distributed(trainer) else wait

    def _supported(self, module: pl.LightningModule) -> bool:
        if len(module.trainer.optimizers) > 1:
            self._unsupported(
                "several optimizers: which loss each optimizer's gradient comes from is the module's own business"
            )
            return False
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and p.is_floating_point()]
        return bool(named)  # nothing to check without (the recomputed checks say so)

    def _unsupported(self, reason: str) -> None:
        """Say once why the applied gradient of this run cannot be checked."""
        if not self._said_unsupported:  # a log record, not a warning: nothing is wrong with the run
            self._said_unsupported = True
            log.warning("gradwatch: the applied gradient is not checked under %s; the recomputed checks go on", reason)

    def check(self, trainer: pl.Trainer, module: pl.LightningModule) -> CheckReport | None:
        """Check the applied gradient if this optimizer step's window was recorded (once per window)."""
        window, self.window = self.window, None
        if window is None or trainer.global_step != self._window_step:
            return None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        skipped = scaler is not None and not all(bool(torch.isfinite(g).all()) for g in grads)
        if scaler is not None and distributed(trainer):  # FSDP2: each rank sees its own rows; decide together
            skipped = trainer.strategy.reduce_boolean_decision(skipped, all=False)
        if skipped:
            # 16-mixed: the grad scaler skips this step (and lowers its scale); the optimizer never applies it
            self._pending = True
            log.info(
                "gradwatch: the grad scaler skips optimizer step %d; the applied check moves on",
                trainer.global_step + 1,
            )
            return None
        self._pending = False
        started = time.perf_counter()
        user_loss = self.loss_fn

        def loss_fn(model: torch.nn.Module, item: Any) -> torch.Tensor:
            batch, batch_idx = item
            return (user_loss or training_step_loss(module, batch_idx))(model, batch)

        accumulate = trainer.accumulate_grad_batches if module.automatic_optimization else 1

        def combine(losses: list[torch.Tensor]) -> torch.Tensor:
            return sum(losses[1:], losses[0]) / accumulate  # Lightning divides each loss, then sums

        sharded = is_sharded([(n, p) for n, p in module.named_parameters() if p.requires_grad])
        # FSDP2: the ranks check together over the parameters' own mesh (the engine finds it); DDP: over the world
        group = torch.distributed.group.WORLD if distributed(trainer) and not sharded else None
        # Under DDP every rank runs the check's evaluations together, so SyncBatchNorm keeps the training's function
        # (statistics over every rank); in a single process it is a BatchNorm
        norms = contextlib.nullcontext() if group is not None or sharded else local_batch_norm(module)
        with norms, loggers_silenced(trainer):
            report = window.check(
                loss_fn,
                combine=combine,
                path=lambda: _forward_context(trainer),
                step=trainer.global_step + 1,
                group=group,
                tensor_probes=self.tensor_probes,
                rotation=self._checks,
                loss_scale=_grad_scale(trainer),
                ignore=self.ignore,
                optimizers=trainer.optimizers,
            )
        self._checks += 1
        self.last_seconds = time.perf_counter() - started
        self.clock.add_check(self.last_seconds)  # inside a training batch: gradwatch's time, not training's
        return report

    def state_dict(self) -> dict[str, Any]:
        return {
            "applied_checks": self._checks,
            "applied_pending": self._pending,
            "applied_resume_at": self._resume_at,
            "applied_last_seconds": self.last_seconds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._checks = int(state.get("applied_checks", 0))
        self._pending = bool(state.get("applied_pending", False))
        self._resume_at = int(state.get("applied_resume_at", 0))
        self.last_seconds = float(state.get("applied_last_seconds", 0.0))


@contextlib.contextmanager
def _forward_context(trainer: pl.Trainer) -> Iterator[None]:
    """The context Lightning runs ``training_step`` in: the precision plugin's (autocast under ``*-mixed``)."""
    with trainer.precision_plugin.forward_context():
        yield


class AppliedHooks(Callback):
    """The hooks ``GradWatch`` runs applied checks from (a mixin: ``GradWatch`` holds ``_applied`` and the watch whose
    alert policy applied failures go through)."""

    _applied: AppliedChecks

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._applied.batch_started(trainer, pl_module, batch, batch_idx)

    @property
    def applied_reports(self) -> list[CheckReport]:
        """The reports of this run's applied checks, oldest first (``scope == "applied"``)."""
        return list(self._applied.reports)

    def _check_applied(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check the applied gradient if this optimizer step is due; keep, publish and alert. A check that raises
        never ends the run (unless ``on_fail="raise"``): it is reported like a recomputed check that raised."""
        alerts: Any = self._watch._alerts  # type: ignore[attr-defined]  # GradWatch's
        try:
            report = self._applied.check(trainer, pl_module)
        except NoLossToCheckError:
            return
        except Exception as error:
            if alerts.on_fail == "raise":
                raise
            alerts.check_error(trainer.global_step + 1, error)
            return
        if report is None:
            return
        self._applied.reports.append(report)
        publish_applied(trainer, report)
        if alerts.handle(report):
            trainer.should_stop = True


def publish_applied(trainer: pl.Trainer, report: CheckReport) -> None:
    """Send an applied check's ``gradwatch/applied/*`` scalars to every logger at its optimizer step, and on rank 0
    write what each logger can show of it (TensorBoard and loggers with text support: a failing check's text, led by
    the fault) and its line of the JSON lines record (:func:`gradwatch.lightning.publishing.write_records`)."""
    records = applied_records_of(report)
    for logger in trainer.loggers:
        logger.log_metrics(records.scalars, step=report.step)
    write_records(trainer, records)
