"""The calls of :class:`~gradwatch.GradientWatch` around the optimizer step, for its applied checks: :meth:`record`
before each micro-batch's forward, :meth:`before_optimizer_step` after the window's backward passes, and
:meth:`after_clipping` once the loop has clipped. A part of the watch (its base class), apart so that each module
stays one screenful of concepts: the recomputed check's call, the state and the outputs are in :mod:`.watch`.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gradwatch.engine import CheckReport, LossFn
from gradwatch.engine import validation as validate
from gradwatch.engine.applied.clipping import GradientNorms, check_clip_norm, check_clipping
from gradwatch.engine.applied.equivalence import Join
from gradwatch.engine.applied.step_hooks import recurring
from gradwatch.engine.applied.window import Combine, PathContext
from gradwatch.engine.distributed.parameters import is_sharded
from gradwatch.engine.results.notes import Note
from gradwatch.engine.selection import checked_parameters
from gradwatch.watch.alerts import GradientCheckWarning
from gradwatch.watch.applied import AppliedSchedule
from gradwatch.watch.distributed import default_group
from gradwatch.watch.hooks import Context, TrainingPath, local_batch_norm
from gradwatch.watch.lessons import Lessons
from gradwatch.watch.outcomes import Outcomes
from gradwatch.watch.schedule import Schedule
from gradwatch.watch.update_calls import UpdateCalls

log = logging.getLogger(__name__)


class AppliedCalls(UpdateCalls):
    """The applied-check calls of a watch (see the module doc) and what both kinds' calls share (the loss a call
    checks, the contexts around a check); the watch holds the state they use. The update check each verified gradient
    leads to is :class:`~gradwatch.watch.update_calls.UpdateCalls`'."""

    verbose: bool
    _applied: AppliedSchedule
    _schedule: Schedule
    _lessons: Lessons
    _outcomes: Outcomes
    _model: nn.Module | None
    _last_step: int
    _decide: Callable[[int], int]
    _context: Context
    loss_fn: LossFn | None

    def _loss_fn(self, loss_fn: LossFn | None, step: int) -> LossFn:
        validate.check_int("step", step, minimum=0)
        chosen = validate.check_optional_callable("loss_fn", loss_fn if loss_fn is not None else self.loss_fn)
        if chosen is None:
            raise ValueError("`loss_fn` must be given, to the watch or to this call: gradwatch needs the loss to check")
        return chosen

    def guarded(self, site: str) -> contextlib.AbstractContextManager[None]:
        """A context for what a watch or its adapter runs outside a check (``site`` names it): an error there is one
        note (:attr:`notes`) and one warning, once per site, and the block is left; training goes on (see
        :mod:`gradwatch.watch.guard`).

        Args:
            site: The call site, as the note and the warning name it (``"watch.record"``, ...).
        """
        return self._outcomes.guard(site)

    @property
    def notes(self) -> list[Note]:
        """What the watch's own calls outside a check could not do (code ``watch-error``), one note per call site."""
        return list(self._outcomes.guard.notes)

    def _contexts(self, model: nn.Module, *, local: bool) -> list[contextlib.AbstractContextManager[Any]]:
        """The loop's context around a check, and for a check each process makes alone, SyncBatchNorm local."""
        return [self._context(model), local_batch_norm(model) if local else contextlib.nullcontext()]

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
        self._update_release()
        if not self._applied.enabled:
            return
        step = self._last_step + 1 if step is None else validate.check_int("step", step, minimum=1)
        key = _optimizer("optimizer", optimizer)
        with self.guarded("watch.record"):  # its float64 checksums of the gradients may run out of memory
            self._applied.record(batch, model if model is not None else self._model, step, self._decide, key)
            return
        self._applied.abandon()

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
        (``check_update=True``, the default; :mod:`gradwatch.watch.update_calls`): its report joins :attr:`reports`.

        Args:
            model: The module whose ``.grad`` the optimizer applies.
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
        """
        validate.check_int("step", step, minimum=1)
        optimizer = _optimizer("optimizer", optimizer)
        if max_norm is not None and (isinstance(max_norm, bool) or not isinstance(max_norm, (int, float))
                                     or not max_norm > 0):  # fmt: skip
            raise ValueError(f"`max_norm` must be a positive number or None; got {max_norm!r}")
        _updated(model, optimizer)  # an optimizer that updates none of the model's parameters is the caller's error
        if training is None:
            training = TrainingPath(combine, path, join, window_normalised)
        elif (combine, path, join, window_normalised) != ("mean", None, None, False):
            raise ValueError("give `training` or `combine`, `path`, `join` and `window_normalised`, not both")
        with self.guarded("watch.before_optimizer_step"):
            return self._before_optimizer_step(
                model, loss_fn, step=step, training=training, group=group, loss_scale=loss_scale, gradients=gradients,
                skipped=skipped, optimizers=optimizers, optimizer=optimizer, max_norm=max_norm,
            )  # fmt: skip
        return None

    def _before_optimizer_step(
        self, model: nn.Module, loss_fn: LossFn | None, *, step: int, training: TrainingPath, group: Any,
        loss_scale: float, gradients: Mapping[str, torch.Tensor] | None, skipped: bool | Callable[[], bool],
        optimizers: Sequence[torch.optim.Optimizer], optimizer: Any, max_norm: float | None,
    ) -> CheckReport | None:  # fmt: skip
        self._update_release(step)
        if self.check_update and self._applied.enabled and self._applied.due(step + 1, step):
            self._update_keep_previous(model, step, optimizer, optimizers, _updated(model, optimizer))
        self._model, self._last_step = model, max(self._last_step, step)
        if self._applied.enabled:  # a loop that makes only applied checks measures its training time here
            self._schedule.clock.batch_ended(time.perf_counter())
        window = self._applied.take(step, optimizer)
        if window is None and self._applied.unrecorded(step):
            warnings.warn(
                f"gradwatch: the applied check due at optimizer step {step} has no recorded window: no applied check "
                "runs until watch.record(batch) is called before each micro-batch's forward, with the step "
                "before_optimizer_step is then given (said once)",
                GradientCheckWarning,
                stacklevel=2,
            )
        if window is None or not self._lessons.checkable(model):
            return None
        if skipped() if callable(skipped) else skipped:
            self._applied.skipped()
            if self.verbose:
                log.info("gradwatch: the optimizer skips step %d; the applied check moves to the next window", step)
            return None
        guard = self._outcomes.guard
        loss_fn = guard.callers(self._loss_fn, loss_fn, step)  # bad arguments are the caller's errors
        updated, own = guard.callers(_updated, model, optimizer), gradients is None
        if updated is not None:  # the optimizer's own parameters, their gradients (or those given) alone
            given = gradients if gradients is not None else {name: p.grad for name, p in updated if p.grad is not None}
            only = {name for name, _ in updated}
            gradients = {name: g for name, g in given.items() if name in only}
            if not {name for name, _ in checked_parameters(model, self._lessons.active.ignore)} & set(gradients):
                return None  # nothing this optimizer applies is checked here (ignore=: another watch's optimizer)
            optimizers = (*optimizers, optimizer) if all(o is not optimizer for o in optimizers) else optimizers
        if group == "auto":
            group = default_group(model)
        started = time.perf_counter()
        active = self._lessons.active
        check = lambda: window.check(  # noqa: E731
            loss_fn, model, step=step, group=group, loss_scale=loss_scale, gradients=gradients,
            optimizers=tuple(optimizers), rotation=self._applied.checks, settings=active, **training.arguments(),
        )  # fmt: skip
        # ranks that check together keep SyncBatchNorm's statistics over every rank, the training's function
        local = group is None and not is_sharded(list(model.named_parameters()))
        try:
            report = self._outcomes.guarded(step, check, self._contexts(model, local=local))
        finally:
            self._applied.ran(time.perf_counter() - started)
        if report is not None:
            report = recurring(report, self._applied.faults.get(id(optimizer)))
            self._applied.faults[id(optimizer)] = (step, report.fault)
            self._outcomes.publish(report, self._schedule.overhead())
        if report is not None:
            # what clipping must keep of the verified gradient: its norms (a few numbers, no copy); for gradients an
            # engine keeps elsewhere (it clips them itself, out of .grad) only their global norm is of use
            with self.guarded("the clip check's norms of the verified gradient"):
                held = _gradients(model, updated) if own else list((gradients or {}).values())
                norms = GradientNorms.of(held)
                self._applied.verified = (step, norms, own)
            # an engine's own gradients (DeepSpeed's partitions) and a scaled gradient (a float16 grad scaler, which
            # unscales it after this call) are not what the optimizer steps with: their update is not checked here
            if own and loss_scale == 1.0:
                with self.guarded("the update check's copies before the step"):
                    self._update_prepare(model, step, optimizer, optimizers, updated, norms.total, max_norm)
        return report

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
            model: The model whose gradient was clipped.
            max_norm: The clipping threshold (``clip_grad_norm_``'s ``max_norm``).
            step: The optimizer step, the one :meth:`before_optimizer_step` was given.
            clipped_with: For an engine that clips the gradient in its own partitions, out of ``.grad`` (DeepSpeed,
                after ``engine.step()``: ``engine.get_global_grad_norm()``), the norm it clipped with, checked against
                the verified gradient's (:func:`~gradwatch.engine.applied.clipping.check_clip_norm`), or a function
                that reads it, called only when a check verified this step's gradient (reading it may wait for the
                device; ``None`` from it: nothing to check); without it such a gradient (checked with ``gradients=``)
                is not checked here.
        """
        with self.guarded("watch.after_clipping"):
            return self._after_clipping(model, max_norm, step=step, clipped_with=clipped_with)
        return None

    def _after_clipping(
        self, model: nn.Module, max_norm: float, *, step: int, clipped_with: float | Callable[[], float | None] | None
    ) -> CheckReport | None:
        self._update_declare(step, max_norm)
        verified, self._applied.verified = self._applied.verified, None
        if verified is None or verified[0] != step:
            return None
        norms, own = verified[1], verified[2]
        if clipped_with is not None:
            used = clipped_with() if callable(clipped_with) else clipped_with
            if used is None:
                return None
            check = lambda: check_clip_norm(norms, float(used), max_norm, step=step)  # noqa: E731
        elif own:
            check = lambda: check_clipping(norms, _gradients(model), max_norm, step=step)  # noqa: E731
        else:
            return None
        report = self._outcomes.guarded(step, check, [])
        if report is not None:
            self._outcomes.publish(report, self._schedule.overhead())
        return report


def _gradients(model: nn.Module, updated: list[tuple[str, nn.Parameter]] | None = None) -> list[torch.Tensor | None]:
    """Each trainable parameter's ``.grad`` (of those an optimizer updates, when given), in order."""
    if updated is not None:
        return [p.grad for _, p in updated]
    return [p.grad for p in model.parameters() if p.requires_grad]


def _optimizer(name: str, optimizer: Any) -> Any:
    """``optimizer``: ``None`` or an object with ``param_groups`` (a ``torch.optim.Optimizer``), else a clear error."""
    if optimizer is not None and not isinstance(getattr(optimizer, "param_groups", None), list):
        kind = type(optimizer).__name__
        raise ValueError(f"`{name}` must be a torch.optim.Optimizer (with param_groups); got {kind}")
    return optimizer


def _updated(model: nn.Module, optimizer: Any) -> list[tuple[str, nn.Parameter]] | None:
    """The trainable parameters of ``model`` that ``optimizer`` updates, by name (``None`` without an optimizer)."""
    if optimizer is None:
        return None
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    updated = [(name, p) for name, p in model.named_parameters() if id(p) in ids and p.requires_grad]
    if not updated:
        raise ValueError("`optimizer` updates none of the model's trainable parameters")
    return updated
