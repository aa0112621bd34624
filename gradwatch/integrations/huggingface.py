"""``GradWatchCallback``: gradient checks in a Hugging Face ``transformers.Trainer`` run (and the TRL trainers on it).

A thin adapter over :class:`gradwatch.watch.GradientWatch`: it wraps ``trainer.compute_loss`` to see each micro-batch
(a shallow copy of the inputs, with the Trainer's ``num_items_in_batch``), which a due window records for the applied
check, and ``accelerator.clip_grad_norm_``, where the applied check runs before it clips (under DeepSpeed: inside the
engine's step); the recomputed check runs at ``on_step_end`` on the step's first micro-batch. The watch's state rides
in the Trainer's checkpoints (``stateful_callbacks``); what ``compute_loss`` records during a check (TRL's metrics) is
put back after it (:mod:`.trainer_records`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from typing_extensions import Unpack

from gradwatch.engine import CheckReport, LossFn
from gradwatch.engine.settings import ProbeSettings
from gradwatch.engine.validation import suggests_options
from gradwatch.integrations.deepspeed import _engine_checks as engine_checks
from gradwatch.integrations.loggers import logger_sinks, trainer_runs
from gradwatch.integrations.trainer_losses import compute_loss_with_count, no_micro_batch, trainer_options
from gradwatch.integrations.trainer_path import TrainerPath
from gradwatch.integrations.trainer_records import records_kept
from gradwatch.outputs.sinks import LogCallSink, Sink
from gradwatch.tensorboard.writer import TRAINER_PREFIX
from gradwatch.watch.alerts import GradientCheckWarning
from gradwatch.watch.guard import guarded_hook
from gradwatch.watch.hooks import Agree, Context, Decide
from gradwatch.watch.options import WatchedReports, WatchOptions
from gradwatch.watch.watch import GradientWatch

__all__ = ["STATE_KEY", "GradWatchCallback"]

STATE_KEY = "gradwatch"
"""The key of the watch's state in ``TrainerState.stateful_callbacks``, which the Trainer saves in each checkpoint's
``trainer_state.json`` and reads back on ``trainer.train(resume_from_checkpoint=...)``. Not the callback's class name:
with ``restore_callback_states_from_checkpoint=True`` the Trainer rebuilds a callback of that name from JSON arguments,
which cannot hold the trainer."""


def _stateful(state: TrainerState) -> dict[str, Any]:
    """``state.stateful_callbacks``, where the Trainer's next checkpoint saves the watch's state (a list before
    ``TrainerState`` turns it into a dict of states by name)."""
    if not isinstance(state.stateful_callbacks, dict):
        state.stateful_callbacks = {}  # type: ignore[assignment]
    return cast(dict[str, Any], state.stateful_callbacks)


def run_sinks(
    trainer: Trainer, args: TrainingArguments, state: TrainerState, log: Callable[[dict[str, float | str], int], object]
) -> list[Sink]:
    """The sinks of one run, from the Trainer's ``report_to`` integrations: on every process the scalars through
    ``log(values, step)`` (``trainer.log``, which reaches every integration); on the main process what each integration
    shows besides scalars and the JSON lines record beside its run (:mod:`gradwatch.integrations.loggers`)."""
    sinks: list[Sink] = [LogCallSink(log)]
    if state.is_world_process_zero:
        sinks += logger_sinks(trainer_runs(trainer, args), prefix=TRAINER_PREFIX)
    return sinks


class TrainerLog:
    """A check's values through ``trainer.log``: at once, or for an applied check (made before its optimizer step) at
    that step's end (:meth:`flush`)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.pending: list[dict[str, float | str]] = []

    def __call__(self, values: dict[str, float | str], step: int) -> None:
        if step > self.trainer.state.global_step:
            self.pending.append(values)
            return
        # Trainer.log clears control.should_log, which the Trainer set for its own entry of this step: put it back, or
        # the Trainer would skip (and later average over) the loss it logs at this step
        should_log = self.trainer.control.should_log
        # The base class's log: a subclass's (TRL's) merges the metrics it gathered since its last entry into any entry
        # and clears them, so they would move from the Trainer's own entry of this step into gradwatch's.
        Trainer.log(self.trainer, cast(dict[str, float], values))
        self.trainer.control.should_log = should_log

    def flush(self) -> None:
        """Log the values held back for the step that just ended."""
        pending, self.pending = self.pending, []
        for values in pending:
            self(values, self.trainer.state.global_step)


class GradWatchCallback(WatchedReports, TrainerCallback):
    r"""Check, every so often during a ``transformers.Trainer`` run, that the gradients are the derivatives of the loss.

    Both kinds of check, on the watch's one schedule and budget. The **applied** check (every ``applied_every_n_steps``
    optimizer steps, and at ``first_check_step``) checks the accumulated gradient the optimizer is about to apply,
    before the Trainer clips it, against the loss of the whole window as the Trainer trains on it (its ``compute_loss``
    on each micro-batch, combined as its ``training_step`` combines them, under its autocast), and names a wrong
    gradient's fault (``"precision"``, ``"accumulation"``, ...). The **recomputed** check (every ``every_n_steps``, and
    at ``first_check_step``) evaluates the Trainer's own ``compute_loss`` on the step's first micro-batch, with its
    ``num_items_in_batch``, at the parameters after the step, and names the module whose backward is wrong. Training is
    left bit for bit as it would be without the callback (parameters, optimizer and random states, the Trainer's log).

    Each check's scalars (``gradwatch/verdict``, ``gradwatch/rel_error_max_log10``, ..., ``gradwatch/overhead``) go
    through ``trainer.log`` to every ``report_to`` integration, as a ``log_history`` entry of their own; a TensorBoard
    run also gets the histogram of log10 relative errors and a failing check's text with the culprit
    (``train/gradwatch/failures``); ``gradwatch.jsonl`` beside the logs (the TensorBoard run's directory, else
    ``output_dir``) gets one line per check, which ``gradwatch report`` reads. Failures warn (a
    :class:`~gradwatch.GradientCheckWarning` with the culprit), as ``on_fail`` says. The watch's state (schedule,
    budget, counters, backoff) is saved in the Trainer's checkpoints and restored by ``resume_from_checkpoint``.

    Args:
        trainer: The ``Trainer`` to watch; add the callback to it with ``trainer.add_callback(callback)``.

    Keyword Args:
        settings: The probe options as one :class:`~gradwatch.engine.settings.ProbeSettings` (then none one by one).
        sinks: More outputs for every check's records, besides the run's own.
        decide: The budget decision every process takes; by default rank 0's (:mod:`gradwatch.watch.distributed`).
        agree: The report every process acts on; by default the same on every process
            (:mod:`gradwatch.watch.distributed`).
        context: A context manager around each check (see :class:`~gradwatch.GradientWatch`).
        on_report: Called with each report (see :class:`~gradwatch.GradientWatch`).
        **options: The options of :class:`~gradwatch.GradientWatch` by name, with its defaults (``every_n_steps``,
            ``first_check_step``, ``applied_every_n_steps``, ``on_fail``, ``loss_fn``, ``max_overhead``,
            ``max_reports``, ``verbose``, ``check_update``), and the probe options (``tensor_probes``, ``precision``,
            ``ignore``, ...), the fields of :class:`~gradwatch.engine.settings.ProbeSettings`. Here ``loss_fn(model,
            inputs)`` is checked instead of ``trainer.compute_loss`` (a GRPO-style trainer's own loss is checked with
            ``hold_detached``: :mod:`gradwatch.integrations.trainer_losses`), ``on_fail="stop"`` stops training at the
            end of the step, applied checks are not made under FSDP (said once), and ``check_update`` checks the update
            after ``max_grad_norm``'s clip, from a step hook on the Trainer's optimizer.

    Raises:
        TypeError: An unknown option (named, with the nearest valid name).
        ValueError: ``trainer`` is no ``transformers.Trainer``, or an option is out of range or of the wrong type.

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        trainer.add_callback(GradWatchCallback(trainer, every_n_steps=100))
        trainer.train()
    """

    @suggests_options(WatchOptions)
    def __init__(
        self,
        trainer: Trainer,
        *,
        settings: ProbeSettings | None = None,
        sinks: Sequence[Sink] = (),
        decide: Decide | None = None,
        agree: Agree | None = None,
        context: Context | None = None,
        on_report: Callable[[CheckReport], object] | None = None,
        **options: Unpack[WatchOptions],
    ):
        if not isinstance(trainer, Trainer):
            raise ValueError(f"`trainer` must be a transformers.Trainer; got {type(trainer).__name__}")
        self.trainer = trainer
        self.watch = GradientWatch(
            settings=settings, sinks=sinks, on_report=on_report, decide=decide, agree=agree,
            context=self._records_kept, **trainer_options(trainer, settings, options),
        )  # fmt: skip
        self._sinks = tuple(sinks)  # the user's; the run's own are added at each on_train_begin
        self._context = context
        self._kept: tuple[dict[str, Any], Any] | None = None  # (inputs, num_items_in_batch) of the step's micro-batch
        self._keep_next = False  # the next micro-batch of the step is kept
        self._wrapped = False
        self._engine_hook: Any = None  # under DeepSpeed: the applied check inside the engine's step
        self._log = TrainerLog(trainer)  # an applied check's values logged at the end of the step they belong to
        self._in_window = False  # the micro-batches run are recorded for the applied check, until its check point
        self._window_count: Any = None  # num_items_in_batch of the window's micro-batches
        self._window_first: dict[str, Any] | None = None  # the inputs of the window's first micro-batch
        self._applied_off: str | None = None  # why this run's applied gradient cannot be reached

    @property
    def loss_fn(self) -> LossFn | None:
        """The loss checked instead of ``trainer.compute_loss`` (``None``: the Trainer's own)."""
        return self.watch.loss_fn

    # --- the Trainer's events --------------------------------------------------------------------------------------

    @guarded_hook("GradWatchCallback.on_train_begin")
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        if not self._wrapped:
            # an instance attribute shadows the method (a subclass's override included) for the run's duration
            self._compute_loss = self.trainer.compute_loss
            self.trainer.compute_loss = self._keeping_compute_loss  # type: ignore[method-assign]
            # the gradient before the Trainer clips it: the applied check runs first thing in the clipping call
            self._clip_grad_norm = self.trainer.accelerator.clip_grad_norm_
            self.trainer.accelerator.clip_grad_norm_ = self._clipping  # type: ignore[method-assign]
            self._wrapped, self._applied_off = True, None
            if self.watch.applied_every_n_steps is not None and getattr(self.trainer, "is_fsdp_enabled", False):
                self._no_applied(
                    "the callback does not pass FSDP's sharded gradients to the applied check yet (untested)"
                )
            if self._applied_off is None and getattr(self.trainer, "is_deepspeed_enabled", False):
                # the engine steps inside accelerator.backward: the check sits at its boundary, before its clipping
                self._engine_hook = engine_checks(self.trainer.model_wrapped, self._check_applied, self._engine_clipped)
        self.watch.sinks = (*self._sinks, *run_sinks(self.trainer, args, state, self._log))
        saved = _stateful(state).get(STATE_KEY)  # a checkpoint's, on resume
        if isinstance(saved, dict):
            self.watch.load_state_dict(saved)
        _stateful(state)[STATE_KEY] = self.watch.state_dict()
        self.watch.setup(self._model)
        self.watch.start(state.global_step)

    @guarded_hook("GradWatchCallback.on_epoch_end")
    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        _stateful(state)[STATE_KEY] = self.watch.state_dict()  # a checkpoint saved at the epoch's end

    @guarded_hook("GradWatchCallback.on_train_end")
    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        _stateful(state)[STATE_KEY] = self.watch.state_dict()  # trainer.save_state() after the run
        if self._wrapped and "compute_loss" in vars(self.trainer):
            del self.trainer.compute_loss
        if self._engine_hook is not None:
            self._engine_hook.remove()
            self._engine_hook = None
        if self._wrapped and "clip_grad_norm_" in vars(self.trainer.accelerator):
            del self.trainer.accelerator.clip_grad_norm_
        self._wrapped, self._in_window, self._kept = False, False, None
        self.watch.sinks = self._sinks  # the run's writers close with it

    @guarded_hook("GradWatchCallback.on_step_begin")
    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        # keep a micro-batch only for a step that may be checked (a due or postponed check)
        self._keep_next = self.watch.due_next(state.global_step)
        self._kept = None
        self._in_window, self._window_count, self._window_first = self._applied_off is None, None, None

    @guarded_hook("GradWatchCallback.on_pre_optimizer_step")
    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ):
        if not self._in_window or self._engine_hook is not None:
            return  # checked in the clipping call or inside DeepSpeed's step, as it should be
        if args.max_grad_norm > 0:
            # the Trainer clipped elsewhere (gradients on several device meshes, SageMaker): what the optimizer applies
            # is no longer the window's gradient, and a check of it would be a false alarm
            self._no_applied(
                "the Trainer clipped the gradient without accelerator.clip_grad_norm_ (gradients on several device "
                "meshes, or SageMaker model parallelism), so the gradient before clipping cannot be reached"
            )
            self._in_window = False
            self.watch.before_optimizer_step(self._model, no_micro_batch, step=state.global_step + 1, skipped=True)
            return
        self._check_applied()

    @guarded_hook("GradWatchCallback.on_step_end")
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        self._log.flush()
        kept, self._kept, self._keep_next = self._kept, None, False
        # called at every step, due or not: the watch measures the training time between calls
        inputs, num_items_in_batch = kept if kept is not None else (None, None)
        loss_fn = self.loss_fn or (self._trainer_loss(num_items_in_batch) if kept is not None else no_micro_batch)
        self.watch.maybe_check(
            self._model,
            inputs,
            loss_fn,
            step=state.global_step,
            skipped=lambda: bool(getattr(self.trainer.accelerator, "optimizer_step_was_skipped", False)),
            optimizers=() if self.trainer.optimizer is None else (self.trainer.optimizer,),
        )
        if control.should_save or control.should_evaluate or control.should_training_stop:
            # before the Trainer saves a checkpoint of this step (DefaultFlowCallback, which runs before this callback,
            # asked for one, or for an evaluation that may save the best model), not at every step: a state_dict
            # costs more than the rest of an idle step; the epoch's and the run's ends keep it too
            _stateful(state)[STATE_KEY] = self.watch.state_dict()
        if self.watch.should_stop:  # on_fail="stop" and the check failed
            control.should_training_stop, self.watch.should_stop = True, False

    @property
    def _model(self) -> nn.Module:
        """The model the Trainer trains (unwrapped: a DDP wrapper would run its reductions on the check's passes)."""
        if self.trainer.model is None:
            raise RuntimeError("gradwatch: the Trainer has no model yet")
        return self.trainer.model

    # --- the applied check ------------------------------------------------------------------------------------------

    def _clipping(self, parameters: Any, max_norm: float, norm_type: float = 2, **kwargs: Any) -> Any:
        """``accelerator.clip_grad_norm_``, after the applied check of the window; then, when that check verified the
        gradient, the check of the clip coefficient (``watch.after_clipping``). Not under a grad scaler: the check ran
        on the scaled gradient, which the clipping call unscales."""
        self._check_applied()
        norm = self._clip_grad_norm(parameters, max_norm, norm_type=norm_type, **kwargs)  # training's: not guarded
        try:  # at every step: a guard by try/except (see GradientWatch.absorbs)
            finite = isinstance(max_norm, (int, float)) and 0 < max_norm < float("inf") and norm_type == 2
            # not under DeepSpeed either: its engine clips its own partitioned gradients, inside its step
            if finite and getattr(self.trainer.accelerator, "scaler", None) is None and self._engine_hook is None:
                self.watch.after_clipping(self._model, float(max_norm), step=self.trainer.state.global_step + 1)
        except Exception as error:
            if not self.watch.absorbs("GradWatchCallback's check of the clip coefficient", error):
                raise
        return norm

    @guarded_hook("GradWatchCallback's check of the engine's clip norm")
    def _engine_clipped(self, max_norm: float, norm: Callable[[], float | None]) -> None:
        """Under DeepSpeed, after the engine's step: the norm it clipped with (read only if a check verified this step's
        gradient) against the verified gradient's."""
        step = self.trainer.state.global_step + 1  # the engine steps before the Trainer counts the step
        self.watch.after_clipping(self._model, max_norm, step=step, clipped_with=norm)

    @guarded_hook("GradWatchCallback's applied check")
    def _check_applied(self, gradients: Mapping[str, torch.Tensor] | None = None) -> None:
        """The applied check of the window just run, when one is due: the accumulated ``.grad`` (or the ``gradients``
        a DeepSpeed engine keeps) before clipping, against the window's loss along the Trainer's path."""
        if not self._in_window:
            return
        self._in_window = False  # the check's own calls of compute_loss are not the window's
        optimizers = () if self.trainer.optimizer is None else (self.trainer.optimizer,)
        if not self.watch.recording:  # no window kept, so no check: the watch's bookkeeping of the step alone
            step = self.trainer.state.global_step + 1
            self.watch.before_optimizer_step(self._model, step=step, gradients=gradients, optimizers=optimizers)
            return
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        path = TrainerPath(
            self.trainer, self._model, self._trainer_loss, self.loss_fn, count=self._window_count,
            first=self._window_first,
        )  # fmt: skip
        with path.unwrapped():
            self.watch.before_optimizer_step(
                self._model,
                path.loss,
                step=self.trainer.state.global_step + 1,
                training=path.training(),
                loss_scale=float(scaler.get_scale()) if scaler is not None else 1.0,  # unscaled after this call
                gradients=gradients,
                optimizers=optimizers,
            )

    def _no_applied(self, why: str) -> None:
        """No applied checks in this run, said once: ``why``."""
        self._applied_off = why
        message = f"gradwatch: no applied checks in this run: {why}; the recomputed checks go on"
        warnings.warn(message, GradientCheckWarning, stacklevel=3)

    # --- the loss ---------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _records_kept(self, model: nn.Module) -> Iterator[None]:
        """Around each check: what the trainer's ``compute_loss`` records (TRL's ``_metrics``, token counts) is put
        back afterwards; inside it, the ``context`` given to the callback, if any."""
        with records_kept(self.trainer), self._context(model) if self._context else contextlib.nullcontext():
            yield

    def _keeping_compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        if model.training and (self._keep_next or self._in_window):
            self._keep(inputs, num_items_in_batch)
        # the training's own loss, outside any guard: its errors are the training's
        return self._compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    @guarded_hook("GradWatchCallback's record of a micro-batch")
    def _keep(self, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None) -> None:
        """A micro-batch of the step kept for the recomputed check, and of a due window recorded for the applied one."""
        kept = dict(inputs)  # compute_loss may pop the labels
        if self._keep_next:
            self._kept, self._keep_next = (kept, num_items_in_batch), False
        if self._in_window:
            self._window_count = num_items_in_batch
            self._window_first = self._window_first if self._window_first is not None else kept
            step = self.trainer.state.global_step + 1
            self.watch.record((kept, num_items_in_batch), model=self._model, step=step)

    def _trainer_loss(self, num_items_in_batch: torch.Tensor | int | None) -> LossFn:
        return compute_loss_with_count(self._compute_loss, num_items_in_batch)
