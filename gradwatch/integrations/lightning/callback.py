"""``GradWatch``: the Lightning callback that checks gradients from time to time while a run trains.

A thin adapter over :class:`gradwatch.watch.GradientWatch`: ``on_train_batch_start`` records the micro-batch and its
index; ``on_before_optimizer_step`` (after accumulation, the cross-rank reduction and the 16-mixed unscale, before
clipping) runs the applied check, with the module's own ``training_step`` as the loss (each micro-batch's divided by
``accumulate_grad_batches`` and summed) on the precision plugin's forward context; ``on_train_batch_end`` runs the
recomputed check. Around every check the trainer's loggers are silenced (:func:`.training_step.loggers_silenced`); the
records go to the loggers (:mod:`.publishing`, :mod:`gradwatch.integrations.loggers`) and the progress bar.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.hooks import RemovableHandle
from typing_extensions import Unpack, override

from gradwatch.engine.settings import ProbeSettings
from gradwatch.engine.validation import suggests_options
from gradwatch.integrations.lightning.manual_step import Earlier, before_update, manual_step_loss
from gradwatch.integrations.lightning.publishing import TrainerSink, publish_dashboard, show_in_progress_bar
from gradwatch.integrations.lightning.training_step import joined_window, loggers_silenced, training_step_loss
from gradwatch.integrations.loggers import lightning_runs, logger_sinks
from gradwatch.watch.guard import guarded_hook
from gradwatch.watch.hooks import TrainingPath
from gradwatch.watch.options import WATCH_OPTIONS, WatchedReports, WatchOptions
from gradwatch.watch.watch import GradientWatch

__all__ = ["GradWatch"]


def _grad_scaler(trainer: pl.Trainer) -> Any:
    """The precision plugin's ``GradScaler`` (``precision="16-mixed"``), or ``None``."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if scaler is not None and hasattr(scaler, "get_scale") else None


class GradWatch(WatchedReports, Callback):
    r"""Check, every so often during training, that the gradients autograd computes are the derivatives of the loss.

    At the chosen optimizer steps, gradwatch re-evaluates the loss of the current batch (the module's own
    ``training_step``, its logging silenced) with small perturbations of sampled parameters and inputs, and compares
    with autograd's gradient of the same loss, computed separately so the training's ``.grad`` is never touched; at
    others it checks the gradient the optimizer applies against the loss of the whole accumulation window. Random
    states, buffers, parameters and ``.grad`` are restored exactly afterwards: training continues as if nothing
    happened. Results go to the trainer's loggers (see the README for the tags) and to :attr:`reports`; failures raise
    an alert. Under DDP every process checks its own shard of the batch and rank 0 decides the budget for all.

    Every option is that of :class:`~gradwatch.GradientWatch`, keyword only, with its default: the watch's options and
    the probe options (``precision``, ``vectorize``, ``ignore``, ``tensor_probes``, ...), the fields of
    :class:`~gradwatch.engine.settings.ProbeSettings`, which may be given as ``settings=`` instead; ``ignore`` patterns
    are matched to the module's parameter names at ``setup``. Each is read back as an attribute of the callback
    (``GradWatch().every_n_steps``, ``GradWatch().probe_batch_size``: the watch's value, a probe option's from its
    :attr:`~gradwatch.GradientWatch.settings`).

    Args:
        settings: The probe options as one :class:`~gradwatch.engine.settings.ProbeSettings` (then none one by one).
        **options: The options of :class:`~gradwatch.GradientWatch` by name (``every_n_steps``, ``first_check_step``,
            ``applied_every_n_steps``, ``on_fail``, ``loss_fn``, ``max_overhead``, ``max_reports``, ``verbose``,
            ``check_update``) and the probe options (2 samples probed unless told). Under Lightning ``on_fail="stop"``
            stops the trainer cleanly; ``loss_fn(module, batch)`` is checked instead of the module's
            ``training_step``, and is required for a module with manual optimization, whose ``training_step`` steps
            the optimizers; ``check_update`` checks the update after ``gradient_clip_val``'s clip.

    Raises:
        TypeError: An unknown option (named, with the nearest valid name).
        ValueError: An argument is out of range or of the wrong type (at construction), or the module uses manual
            optimization and no ``loss_fn`` was given (at ``setup``).

    Example::

        trainer = Trainer(callbacks=[GradWatch()])
        trainer.fit(model, datamodule)
    """

    @suggests_options(WatchOptions)
    def __init__(self, *, settings: ProbeSettings | None = None, **options: Unpack[WatchOptions]) -> None:
        super().__init__()
        self._scale_before: float | None = None  # the GradScaler's scale before a due optimizer step
        self._batch_step = 0  # the optimizer step the batch's window leads to (its first, with several optimizers)
        self._ordinal = 0  # the optimizer steps taken so far in the batch (manual optimization)
        self._stepped: list[tuple[torch.optim.Optimizer, dict[str, torch.Tensor]]] = []  # a checked batch's steps
        self._clip_hooks: list[RemovableHandle] = []  # the hooks after the step that check the clip coefficient
        self._state_key: tuple[tuple[Any, ...] | None, str] = (None, "")  # what the key is made of, and the key
        self._watch = GradientWatch(
            settings=settings, context=loggers_silenced, **options,
        )  # fmt: skip

    def __getattr__(self, name: str) -> Any:
        # the options, read as attributes as they always were: the watch's own, a probe option from its settings
        watch = vars(self).get("_watch")
        if watch is not None and name in WATCH_OPTIONS:
            return getattr(watch, name)
        if watch is not None and name in ProbeSettings.option_names():
            return getattr(watch.settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def watch(self) -> GradientWatch:
        """The watch this callback drives."""
        return self._watch

    @property
    def overhead(self) -> float:
        """gradwatch's time so far as a fraction of the training time (measured between training batches)."""
        return self._watch.overhead

    @property
    def state_key(self) -> str:
        # Lightning reads it at every hook it calls on the callback (six a step, to name the hook's profiler span):
        # it is made again only when what it is made of changed.
        watch = self._watch
        made_of = (watch.loss_fn, watch.settings.ignore, watch.every_n_steps, watch.settings.seed)
        if self._state_key[0] != made_of:
            self._state_key = (made_of, self._make_state_key())
        return self._state_key[1]

    def _make_state_key(self) -> str:
        # Two GradWatch callbacks that check different losses (one per optimizer of a GAN) need keys of their own;
        # a callback with neither keeps the key it always had, so its checkpoints still load.
        distinct: dict[str, Any] = {}
        if self.loss_fn is not None:
            distinct["loss_fn"] = getattr(self.loss_fn, "__qualname__", type(self.loss_fn).__qualname__)
        if self._watch.settings.ignore:
            distinct["ignore"] = list(self._watch.settings.ignore)
        return self._generate_state_key(every_n_steps=self.every_n_steps, seed=self._watch.settings.seed, **distinct)

    def due(self, previous_step: int, step: int) -> bool:
        """Whether a check is due after the optimizer steps ``previous_step < s <= step``.

        Args:
            previous_step: The last optimizer step already considered.
            step: The optimizer step just taken.
        """
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
            self._watch.setup(pl_module)  # ignore= patterns that match nothing warn here, once (guarded there)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_clip_hooks()  # a fit ended between a step's hook and the callback's next call leaves none behind

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the dashboard's layout goes into each TensorBoard run once, before any check, so it is there from the start
        with self._watch.guarded("GradWatch.on_fit_start (the dashboard)"):
            publish_dashboard(trainer)
        with self._watch.guarded("GradWatch.on_fit_start (the sinks)"):
            # built once per run; what each logger shows besides scalars, on rank 0 (it writes files and texts)
            shown = logger_sinks(lightning_runs(trainer), note=True) if trainer.is_global_zero else []
            self._watch.sinks = (TrainerSink(trainer), *shown)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._watch.start(trainer.global_step)  # restored from the checkpoint when resuming

    @override
    @guarded_hook("GradWatch.on_train_batch_start")
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_step, self._ordinal, self._stepped = trainer.global_step + 1, 0, []
        self._watch.record((batch, batch_idx), model=pl_module, step=self._batch_step)

    @override
    @guarded_hook("GradWatch.on_before_optimizer_step")
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._ordinal += 1
        if self._watch.recording:  # the gradient the optimizer applies, before clipping and the step
            earlier = tuple(self._stepped)
            if len(trainer.optimizers) > 1:  # what the parameters held before this update, for the later steps' checks
                self._stepped.append((optimizer, before_update(pl_module, optimizer)))
            self._check_applied(trainer, pl_module, optimizer, earlier)
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
        self._stepped = []  # the batch's copies of parameters before its updates: needed no more
        if self._clip_hooks:
            self._remove_clip_hooks()
        try:  # at every step: a guard by try/except (see GradientWatch.absorbs)

            def skipped() -> bool:  # asked only at a due step
                scaler = _grad_scaler(trainer)
                return scale_before is not None and scaler is not None and scaler.get_scale() < scale_before

            # global_step counts optimizer steps: it does not move on the micro-batches of gradient accumulation
            # (the watch's loss_fn read from it directly, not through the options' __getattr__, at every step)
            loss_fn = self._watch.loss_fn or training_step_loss(pl_module, batch_idx)
            report = self._watch.maybe_check(
                pl_module, batch, loss_fn, step=trainer.global_step, skipped=skipped, optimizers=trainer.optimizers
            )
            if report is not None:
                with self._watch.guarded("GradWatch's progress bar"):
                    show_in_progress_bar(trainer, report, self.counts["failed"])
        except Exception as error:
            if not self._watch.absorbs("GradWatch.on_train_batch_end", error):
                raise
        self._stop_if_asked(trainer)

    def _check_applied(
        self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: torch.optim.Optimizer, earlier: Earlier = ()
    ) -> None:
        user_loss, ordinal = self.loss_fn, self._ordinal
        several = len(trainer.optimizers) > 1  # manual optimization: each optimizer's step on its own loss

        def loss_fn(model: torch.nn.Module, item: Any) -> torch.Tensor:
            batch, batch_idx = item
            if several:
                return manual_step_loss(module, batch_idx, ordinal, optimizer, earlier)(model, batch)
            return (user_loss or training_step_loss(module, batch_idx))(model, batch)

        accumulate = trainer.accumulate_grad_batches if module.automatic_optimization else 1
        scaler = _grad_scaler(trainer)
        clip, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm  # None: by norm
        max_norm = float(clip) if clip and (algorithm is None or str(algorithm).lower().endswith("norm")) else None

        def skipped() -> bool:  # 16-mixed: the grad scaler skips a step with non-finite gradients
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            found = not all(bool(torch.isfinite(g).all()) for g in grads)
            ranks = trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
            # FSDP2: each rank sees its own rows; decide together
            return bool(trainer.strategy.reduce_boolean_decision(found, all=False)) if ranks else found

        training = TrainingPath(
            combine=lambda losses: sum(losses[1:], losses[0]) / accumulate,  # Lightning divides, then sums
            path=trainer.precision_plugin.forward_context, join=joined_window,
        )  # fmt: skip
        self._watch.before_optimizer_step(
            module, loss_fn, step=self._batch_step if several else trainer.global_step + 1, training=training,
            loss_scale=scaler.get_scale() if scaler else 1.0, skipped=skipped if scaler is not None else False,
            optimizers=trainer.optimizers, optimizer=optimizer if several else None,
            max_norm=max_norm,
        )  # fmt: skip
        self._stop_if_asked(trainer)
        if max_norm is not None:
            self._check_clipping_after_step(trainer, module, optimizer, max_norm)

    def _check_clipping_after_step(
        self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> None:
        """Check the clip coefficient (``gradient_clip_val`` by norm) once the optimizer stepped with the clipped
        gradient (Lightning clips after this hook, inside the optimizer's step; ``.grad`` holds what it applied)."""
        step = trainer.global_step + 1
        self._remove_clip_hooks()
        done = [False]

        def after_step(*_: Any) -> None:
            # removed at the callback's next call, not here: removing a hook while torch runs the optimizer's hooks
            # breaks its loop over them ("OrderedDict mutated during iteration") when the user registered one after
            if done[0]:
                return
            done[0] = True
            with self._watch.guarded("GradWatch's hook after the optimizer step"):
                self._watch.after_clipping(module, max_norm, step=step)
            self._stop_if_asked(trainer)

        self._clip_hooks.append(optimizer.register_step_post_hook(after_step))

    def _remove_clip_hooks(self) -> None:
        """Remove the hooks after the step that :meth:`_check_clipping_after_step` registered (they ran or their
        step was skipped), outside the optimizer's loop over its hooks."""
        for handle in self._clip_hooks:
            handle.remove()
        self._clip_hooks = []

    def _stop_if_asked(self, trainer: pl.Trainer) -> None:
        """A stop the watch asks for (``on_fail="stop"`` and a check failed), passed on to the trainer."""
        if self._watch.should_stop:
            trainer.should_stop, self._watch.should_stop = True, False

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._watch.state_dict()  # guarded there, as load_state_dict

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._watch.load_state_dict(state_dict)
