"""``GradWatch``: the Lightning callback that checks gradients from time to time while a run trains.

A thin adapter over :class:`gradwatch.watch.GradientWatch`: it turns Lightning's hooks into
:meth:`~gradwatch.watch.GradientWatch.maybe_check` and lends the watch what only the Trainer knows: the module's own
``training_step`` as the loss (:mod:`.training_step`), rank 0's budget decision and the agreement of the ranks' reports
under DDP (:mod:`.distributed`), the grad scaler's skipped steps, silenced loggers and local batch norm around a check,
and the trainer's loggers and progress bar for the reports (:mod:`.publishing`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from gradwatch.engine import CheckReport, LossFn, check_gradients
from gradwatch.engine import validation as validate
from gradwatch.engine.function.precision import Precision
from gradwatch.engine.settings import ProbeSettings
from gradwatch.lightning.applied import DEFAULT_APPLIED_EVERY_N_STEPS, AppliedChecks, AppliedHooks
from gradwatch.lightning.distributed import agree, distributed
from gradwatch.lightning.publishing import publish, publish_dashboard, show_in_progress_bar
from gradwatch.lightning.training_step import local_batch_norm, loggers_silenced, training_step_loss
from gradwatch.watch.alerts import OnFail
from gradwatch.watch.watch import DEFAULT_EVERY_N_STEPS, DEFAULT_MAX_OVERHEAD, DEFAULT_PROBE_BATCH_SIZE, GradientWatch

__all__ = ["DEFAULT_EVERY_N_STEPS", "DEFAULT_MAX_OVERHEAD", "DEFAULT_PROBE_BATCH_SIZE", "GradWatch"]


def _grad_scaler(trainer: pl.Trainer) -> Any:
    """The precision plugin's ``GradScaler`` (``precision="16-mixed"``), or ``None``."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if scaler is not None and hasattr(scaler, "get_scale") else None


class _Watch(GradientWatch):
    def _check_gradients(self, model: Any, batch: Any, loss_fn: LossFn, **arguments: Any) -> CheckReport:
        return check_gradients(model, batch, loss_fn, **arguments)  # this module's name, which tests may wrap


class GradWatch(AppliedHooks, Callback):
    r"""Check, every so often during training, that the gradients autograd computes are the derivatives of the loss.

    At the chosen optimizer steps, gradwatch re-evaluates the loss of the current batch (the module's own
    ``training_step``, its logging silenced) with small perturbations of sampled parameters and inputs, and compares
    with autograd's gradient of the same loss, computed separately so the training's ``.grad`` is never touched.
    Random states, buffers, parameters and ``.grad`` are restored exactly afterwards: training continues as if nothing
    happened. Results go to the trainer's loggers (see the README for the tags) and to :attr:`reports`; failures raise
    an alert. Under DDP every process checks its own shard of the batch and rank 0 decides the budget for all.

    The arguments ``every_n_steps``, ``first_check_step``, ``on_fail``, ``probe_batch_size``, ``max_overhead``,
    ``max_reports`` and ``verbose`` are those of :class:`~gradwatch.GradientWatch` (``on_fail="stop"`` stops the
    trainer cleanly); the probe options (``precision``, ``vectorize``, ``fail_on_imprecise``, ``ignore``,
    ``tensor_probes``, ``random_probes``, ``param_probes``, ``input_probes``, ``rtol``, ``seed``) are documented once,
    in :class:`~gradwatch.engine.settings.ProbeSettings` (``ignore`` patterns are matched to the module's parameter
    names at ``setup``).

    Args:
        loss_fn: ``loss_fn(module, batch) -> scalar Tensor`` to check instead of the module's ``training_step``.
            Required for modules with manual optimization, whose ``training_step`` steps the optimizers.
        applied_every_n_steps: Check the gradient the optimizer applies, as training computed it, every this many
            optimizer steps (:mod:`gradwatch.lightning.applied`; ``None``: off), within the same ``max_overhead``.

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
        verbose: bool = True,
        applied_every_n_steps: int | None = DEFAULT_APPLIED_EVERY_N_STEPS,
    ) -> None:
        super().__init__()
        self._trainer: pl.Trainer | None = None  # the trainer of the hook being handled (for the watch's hooks)
        self._scale_before: float | None = None  # the GradScaler's scale before a due optimizer step
        self._watch = _Watch(
            every_n_steps=every_n_steps, first_check_step=first_check_step, on_fail=on_fail, loss_fn=loss_fn,
            probe_batch_size=probe_batch_size, max_overhead=max_overhead, precision=precision, vectorize=vectorize,
            fail_on_imprecise=fail_on_imprecise, ignore=ignore, tensor_probes=tensor_probes,
            random_probes=random_probes, param_probes=param_probes, input_probes=input_probes, rtol=rtol, seed=seed,
            max_reports=max_reports, verbose=verbose,
            decide=self._decide, agree=self._agree, context=self._context, on_report=self._publish,
        )  # fmt: skip
        watch = self._watch
        self.every_n_steps, self.first_check_step, self.on_fail = watch.every_n_steps, watch.first_check_step, on_fail
        self.loss_fn, self.max_overhead, self.max_reports = watch.loss_fn, watch.max_overhead, watch.max_reports
        self.verbose = verbose
        for name in ProbeSettings.option_names():  # the probe options, read as attributes as they always were
            setattr(self, name, getattr(watch.settings, name))
        applied = validate.check_optional_int("applied_every_n_steps", applied_every_n_steps, minimum=1)
        clock = watch._schedule.clock  # shared: the applied checks spend the same budget
        self._applied = AppliedChecks(
            applied, self.first_check_step, self.loss_fn, self.max_overhead, clock, ignore=watch.settings.ignore
        )

    @property
    def reports(self) -> list[CheckReport]:
        """The reports of this run's checks, oldest first (at most ``max_reports``)."""
        return self._watch.reports

    @property
    def counts(self) -> dict[str, int]:
        """See :attr:`gradwatch.GradientWatch.counts`."""
        return self._watch.counts

    @property
    def overhead(self) -> float:
        """gradwatch's time so far as a fraction of the training time (measured between training batches)."""
        return self._watch.overhead

    @property
    def state_key(self) -> str:
        # Two GradWatch callbacks that check different losses (one per optimizer of a GAN) need keys of their own;
        # a callback with neither keeps the key it always had, so its checkpoints still load.
        distinct: dict[str, Any] = {}
        if self.loss_fn is not None:
            distinct["loss_fn"] = getattr(self.loss_fn, "__qualname__", type(self.loss_fn).__qualname__)
        if self._watch.settings.ignore:
            distinct["ignore"] = list(self._watch.settings.ignore)
        return self._generate_state_key(every_n_steps=self.every_n_steps, seed=self._watch.settings.seed, **distinct)

    def due(self, previous_step: int, step: int) -> bool:
        """Whether a check is due after the optimizer steps ``previous_step < s <= step``."""
        return self._watch.due(previous_step, step)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not pl_module.automatic_optimization and self.loss_fn is None:
            raise ValueError(
                f"{type(pl_module).__name__} uses manual optimization (automatic_optimization = False): its "
                "training_step steps the optimizers, so gradwatch cannot call it to probe the loss. Pass the loss to "
                "check instead: GradWatch(loss_fn=lambda module, batch: ...)"
            )
        if stage == "fit":
            self._watch.setup(pl_module)  # ignore= patterns that match nothing warn here, once
            self._watch._alerts.shown = trainer.is_global_zero  # every rank holds the same report: one warning

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the dashboard's layout goes into each TensorBoard run once, before any check, so it is there from the start
        publish_dashboard(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._watch.start(trainer.global_step)  # restored from the checkpoint when resuming

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._check_applied(trainer, pl_module)  # the gradient the optimizer applies, before clipping and the step
        # Under 16-mixed the GradScaler skips optimizer steps with non-finite gradients and lowers its scale; the
        # scale is read (a device sync) only before a step that is due for a check.
        scaler = _grad_scaler(trainer)
        if scaler is not None and self._scale_before is None and self._watch.due_next(trainer.global_step):
            self._scale_before = scaler.get_scale()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        scale_before, self._scale_before = self._scale_before, None
        scaler = _grad_scaler(trainer)

        def skipped() -> bool:  # asked only at a due step
            return scale_before is not None and scaler is not None and scaler.get_scale() < scale_before

        # global_step counts optimizer steps: it does not move on the micro-batches of gradient accumulation
        loss_fn = self.loss_fn or training_step_loss(pl_module, batch_idx)
        self._trainer = trainer
        try:
            self._watch.maybe_check(
                pl_module, batch, loss_fn, step=trainer.global_step, skipped=skipped, optimizers=trainer.optimizers
            )
        finally:
            self._trainer = None
        if self._watch.should_stop:  # on_fail="stop" and the check failed
            trainer.should_stop, self._watch.should_stop = True, False

    def _decide(self, wait: int) -> int:
        """Rank 0's budget decision for every rank (ranks measure different times)."""
        assert self._trainer is not None
        return int(self._trainer.strategy.broadcast(wait, src=0))

    def _agree(self, report: CheckReport | None, error: Exception | None, step: int) -> CheckReport | None:
        assert self._trainer is not None
        return agree(self._trainer, report, error) if distributed(self._trainer) else report

    @contextlib.contextmanager
    def _context(self, module: torch.nn.Module) -> Iterator[None]:
        assert self._trainer is not None
        with local_batch_norm(module), loggers_silenced(self._trainer):
            yield

    def _publish(self, report: CheckReport) -> None:
        assert self._trainer is not None
        publish(self._trainer, report, self.overhead)
        show_in_progress_bar(self._trainer, report, self.counts["failed"])

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**self._watch.state_dict(), **self._applied.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._watch.load_state_dict(state_dict)
        self._applied.load_state_dict(state_dict)
