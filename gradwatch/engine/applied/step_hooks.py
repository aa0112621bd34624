"""What may change a gradient between the backward that made it and the optimizer's update: step pre-hooks and
post-accumulate-grad hooks.

An applied gradient that differs from what the training's path computes again, with no leftover, recombination or
reduction to explain it, was changed after the backward. Once (hardware, a race) is a ``"transient"`` fault; every
step (a step pre-hook ``optimizer.register_step_pre_hook``, global or the optimizer's own, that edits ``.grad``; a
callback or a loop that scales it; a post-accumulate-grad hook that rescales the accumulated ``.grad``) is a
``"modified"`` one. :func:`step_pre_hooks` names the hooks the optimizers a check knows of would run, and
:func:`accumulate_hooks` the post-accumulate-grad hooks of the tensors that differ: where there are some, the change is
no one-off, and the fault says so from the first check.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradwatch.engine.results.report import CheckReport


def _global_pre_hooks() -> list[Any]:
    """The step pre-hooks every optimizer runs (``torch.optim.optimizer.register_optimizer_step_pre_hook``)."""
    return _theirs(getattr(importlib.import_module("torch.optim.optimizer"), "_global_optimizer_pre_hooks", None))


NOT_THE_USERS = ("gradwatch.", "deepspeed.", "torch.")
"""Where the hooks that are nobody's edit come from: gradwatch's own (a check guards the optimizers with a global
pre-hook while it runs), and a parallelising library's, which *are* its reduction (DeepSpeed's ZeRO reduces each
accumulated gradient from a post-accumulate-grad hook): a wrong gradient there is a ``"reduction"`` fault."""


def _theirs(hooks: Any) -> list[Any]:
    """The hooks someone added to the path: not gradwatch's, not a parallelising library's (:data:`NOT_THE_USERS`)."""
    values = list(hooks.values()) if hasattr(hooks, "values") else []
    return [hook for hook in values if not str(getattr(hook, "__module__", "")).startswith(NOT_THE_USERS)]


def _name(hook: Any) -> str:
    return str(getattr(hook, "__qualname__", None) or type(hook).__qualname__)


def step_pre_hooks(optimizers: Iterable[Any]) -> list[str]:
    """``"Optimizer: hook"`` for each step pre-hook the ``optimizers`` run before their update (global ones as
    ``"every optimizer: hook"``); empty when none."""
    found = [f"every optimizer: {_name(hook)}" for hook in _global_pre_hooks()]
    seen: set[int] = set()
    for optimizer in optimizers:
        raw = getattr(optimizer, "optimizer", optimizer)  # a wrapper (Lightning's, Accelerate's) around the optimizer
        if id(raw) in seen:
            continue
        seen.add(id(raw))
        found += [
            f"{type(raw).__name__}: {_name(hook)}" for hook in _theirs(getattr(raw, "_optimizer_step_pre_hooks", None))
        ]
    return found


def accumulate_hooks(named: Iterable[tuple[str, Any]]) -> list[str]:
    """``"name: hook"`` for each post-accumulate-grad hook (``register_post_accumulate_grad_hook``) on the ``named``
    parameters: it runs on the accumulated ``.grad`` after each backward, where a recomputation of the path (which
    leaves ``.grad`` alone) does not run it, so a hook that rescales the gradient there is a change made at every
    step, on the path from the backward to the optimizer."""
    found = []
    for name, parameter in named:
        found += [f"{name}: {_name(hook)}" for hook in _theirs(getattr(parameter, "_post_accumulate_grad_hooks", None))]
    return found


def accumulate_message(hooks: list[str]) -> str:
    """The words of a ``"modified"`` fault that post-accumulate-grad hooks on the tensors at fault explain."""
    listed = ", ".join(hooks[:4]) + (f" and {len(hooks) - 4} more" if len(hooks) > 4 else "")
    return (
        "the same path, run again on the same micro-batches with the same random states, gives the right gradient: "
        "the applied one was changed after the backward, and the tensors that differ have post-accumulate-grad hooks "
        f"({listed}), which run on the accumulated .grad after each backward: a hook that rescales the gradient there "
        "changes it at every step"
    )


def modified_message(hooks: list[str]) -> str:
    """The words of a ``"modified"`` fault the optimizers' step pre-hooks explain."""
    listed = ", ".join(hooks[:4]) + (f" and {len(hooks) - 4} more" if len(hooks) > 4 else "")
    return (
        "the same path, run again on the same micro-batches with the same random states, gives the right gradient: "
        f"the applied one was changed after the backward, and the optimizer runs step pre-hooks before its update "
        f"({listed}): a hook that edits the gradient changes it at every step"
    )


def recurring_message(previous_step: int) -> str:
    """The words of a ``"modified"`` fault seen again (the applied check before this one had it too)."""
    return (
        "the same path, run again on the same micro-batches with the same random states, gives the right gradient: "
        f"the applied one was changed after the backward, as at the applied check of step {previous_step}: no one-off "
        "corruption but code that edits the gradient between the backward and the optimizer's update (a step "
        "pre-hook, a callback, the loop)"
    )


def recurring(report: CheckReport, previous: tuple[int, str | None] | None) -> CheckReport:
    """``report``, its ``"transient"`` fault called ``"modified"`` when the check before it (``previous``: its step and
    fault, for the same optimizer or window) found one of the two: a change at two checks in a row is no one-off."""
    if report.fault != "transient" or previous is None or previous[1] not in ("transient", "modified"):
        return report
    return report.with_findings(fault="modified", fault_message=recurring_message(previous[0]))
