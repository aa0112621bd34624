"""DeepSpeed (ZeRO stages 1-3): the gradient a ZeRO engine applies, and the one place to check it.

A DeepSpeed engine divides each micro-batch's loss by its accumulation steps, reduces the gradients across the ranks
(partitioning them under stages 2 and 3) and, at the accumulation boundary, clips and steps inside ``engine.step()``.
The gradient it applies is ``deepspeed.utils.safe_get_full_grad(param)`` for each parameter at the boundary, before
``engine.step()``: the full, reduced, accumulated, pre-clip gradient, the mean over ranks and micro-batches
(:func:`full_gradients`; a collective: every rank calls it). The engine's applied check
(:func:`~gradwatch.check_applied_gradient`) takes it as ``gradients=`` and the engine itself (or the module it wraps)
as the model; under ZeRO-3 it gathers the parameters for the check (see :mod:`gradwatch.engine.distributed.zero`).

Where the loop does not call ``engine.step()`` itself (Accelerate and ``transformers.Trainer`` step inside
``accelerator.backward``), :func:`before_engine_steps` runs a check at the boundary all the same: it wraps the ZeRO
optimizer's ``step``, which the engine calls only at the boundary, after the reduction and before clipping.

The engine clips inside that ``step`` (``gradient_clipping``), on the partitions it keeps: :func:`clip_norm` reads the
norm it clipped with afterwards, which ``watch.after_clipping(..., clipped_with=...)`` holds against the verified
gradient's true norm (a norm over one rank's partition, or counted twice, gives every update the wrong scale).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from gradwatch.engine.distributed.zero import FullGradients, clipped_norm, engine_module, full_gradients
from gradwatch.engine.function.evaluation import LossFn
from gradwatch.watch.watch import GradientWatch

__all__ = [
    "EngineStepHook",
    "FullGradients",
    "applied_checks_inside_steps",
    "before_engine_steps",
    "clip_norm",
    "clipped_norm",
    "full_gradients",
]


class EngineStepHook:
    """What :func:`before_engine_steps` installed; :meth:`remove` puts the optimizer's own ``step`` back.

    Args:
        optimizer: The engine's optimizer, whose ``step`` the hook wraps.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.previous = optimizer.__dict__.get("step")  # an instance attribute of its own, if it had one

    def remove(self) -> None:
        if self.previous is not None:
            self.optimizer.step = self.previous
        else:
            self.optimizer.__dict__.pop("step", None)  # the class's own step again


def clip_norm(engine: Any) -> tuple[float, float] | None:
    """``(max_norm, norm)``: the engine's ``gradient_clipping`` and the norm it clipped the last step's gradient with
    (:func:`clipped_norm`); ``None`` when the engine does not clip, keeps no such norm, or skipped the step.

    Args:
        engine: A DeepSpeed engine (``deepspeed.initialize``'s first result).
    """
    engine_module(engine)
    max_norm = float(engine.gradient_clipping() or 0.0)
    norm = clipped_norm(engine) if max_norm > 0 else None
    return None if norm is None else (max_norm, norm)


def before_engine_steps(
    engine: Any, check: Callable[[], Any], after: Callable[[], Any] | None = None
) -> EngineStepHook:
    """Call ``check()`` at every accumulation boundary of ``engine``, just before its optimizer steps: after the
    gradients are reduced, before they are clipped; and ``after()``, if given, once that step (clipping included) is
    over. Both run on every rank (the engine steps on all together) and should not raise; what they return is ignored.
    For loops that step inside another call (Accelerate's ``accelerator.backward``, ``transformers.Trainer``); a plain
    loop checks before its own ``engine.step()``.

    Args:
        engine: A DeepSpeed engine (``deepspeed.initialize``'s first result), with an optimizer.
        check: Called with no argument just before each optimizer step.
        after: Called with no argument once each optimizer step is over.
    """
    engine_module(engine)
    optimizer = engine.optimizer
    if optimizer is None:
        raise ValueError("`engine` has no optimizer: pass one to deepspeed.initialize (or in its config)")
    hook = EngineStepHook(optimizer)
    own = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        check()
        result = own(*args, **kwargs)
        if after is not None:
            after()
        return result

    optimizer.step = step
    return hook


def _engine_checks(
    engine: Any,
    check: Callable[[Mapping[str, Tensor]], None],
    clipped: Callable[[float, Callable[[], float | None]], None],
) -> EngineStepHook:
    """:func:`before_engine_steps` with ``check(gradients)``, the engine's full gradients by name (read only when a due
    check reads them), and after its step, where it clips, ``clipped(max_norm, norm)`` with a function that reads the
    norm it clipped with (:func:`clipped_norm`)."""

    def after() -> None:
        max_norm = float(engine.gradient_clipping() or 0.0)
        if max_norm > 0:
            clipped(max_norm, lambda: clipped_norm(engine))

    return before_engine_steps(engine, lambda: check(FullGradients(engine)), after)


def applied_checks_inside_steps(
    engine: Any, watch: GradientWatch, loss_fn: LossFn | None = None, **options: Any
) -> EngineStepHook:
    """The watch's applied check at every accumulation boundary of ``engine``, inside its step (after the reduction,
    before clipping): :func:`before_engine_steps` calling ``watch.before_optimizer_step(engine.module, loss_fn,
    step=engine.global_steps + 1, gradients=FullGradients(engine), **options)``, and after the step, where the engine
    clips (``gradient_clipping``), the check of the norm it clipped with (``watch.after_clipping(...,
    clipped_with=...)``, :func:`clip_norm`). For loops whose engine steps inside another call (Accelerate's
    ``accelerator.backward``, ``transformers.Trainer``); the loop still records each micro-batch
    (``watch.record(batch, model=engine.module, step=engine.global_steps + 1)``) before its forward.
    :meth:`EngineStepHook.remove` ends it.

    Args:
        engine: A DeepSpeed engine (``deepspeed.initialize``'s first result).
        watch: The :class:`~gradwatch.GradientWatch` whose applied checks run.
        loss_fn: ``loss_fn(module, batch) -> scalar Tensor``; the watch's own by default.
        **options: Passed on to ``watch.before_optimizer_step`` (``combine``, ``path``, ...).
    """
    if not isinstance(watch, GradientWatch):
        raise TypeError(f"`watch` must be a gradwatch.GradientWatch; got {type(watch).__name__}")
    module = engine_module(engine)

    def check(gradients: Mapping[str, Tensor]) -> None:
        with watch.guarded("the DeepSpeed engine's applied check"):
            step = int(engine.global_steps) + 1
            watch.before_optimizer_step(module, loss_fn, step=step, gradients=gradients, **options)

    def clipped(max_norm: float, norm: Callable[[], float | None]) -> None:
        with watch.guarded("the DeepSpeed engine's check of its clip norm"):  # the norm read only if a check verified
            watch.after_clipping(module, max_norm, step=int(engine.global_steps) + 1, clipped_with=norm)

    return _engine_checks(engine, check, clipped)
