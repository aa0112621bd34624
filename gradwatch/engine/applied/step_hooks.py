"""What may change a gradient between the backward that made it and the optimizer's update: step pre-hooks and
post-accumulate-grad hooks.

An applied gradient that differs from what the training's path computes again, with no leftover, recombination or
reduction to explain it, was changed after the backward: once (hardware, a race) is a ``"transient"`` fault, every step
(a step pre-hook that edits ``.grad``, a callback, a post-accumulate-grad hook) a ``"modified"`` one.
:func:`step_pre_hooks` and :func:`accumulate_hooks` name such hooks: where there are some, the fault says so from the
first check.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradwatch.engine.results.report import CheckReport


def _global_pre_hooks() -> list[Any]:
    return _theirs(getattr(importlib.import_module("torch.optim.optimizer"), "_global_optimizer_pre_hooks", None))


NOT_THE_USERS = ("gradwatch.", "deepspeed.", "torch.")
"""Where the hooks that are nobody's edit come from: gradwatch's own (a check guards the optimizers with a global
pre-hook), and a parallelising library's, which *are* its reduction (DeepSpeed's ZeRO reduces from a
post-accumulate-grad hook)."""


def _theirs(hooks: Any) -> list[Any]:
    """The hooks someone added to the path (not from :data:`NOT_THE_USERS`)."""
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
    """``"name: hook"`` for each post-accumulate-grad hook on the ``named`` parameters: it runs on the accumulated
    ``.grad`` after each backward, where a recomputation of the path does not, so a hook that rescales it there changes
    the gradient at every step."""
    found = []
    for name, parameter in named:
        found += [f"{name}: {_name(hook)}" for hook in _theirs(getattr(parameter, "_post_accumulate_grad_hooks", None))]
    return found


RIGHT_AGAIN = "the same path, run again on the same micro-batches with the same random states, gives the right gradient"
CHANGED = f"{RIGHT_AGAIN}: the applied one was changed after the backward"


def _listed(hooks: list[str]) -> str:
    return ", ".join(hooks[:4]) + (f" and {len(hooks) - 4} more" if len(hooks) > 4 else "")


def accumulate_message(hooks: list[str]) -> str:
    """The words of a ``"modified"`` fault that post-accumulate-grad hooks on the tensors at fault explain."""
    return (
        f"{CHANGED}, and the tensors that differ have post-accumulate-grad hooks ({_listed(hooks)}), which run on the "
        "accumulated .grad after each backward: a hook that rescales the gradient there changes it at every step"
    )


def modified_message(hooks: list[str]) -> str:
    """The words of a ``"modified"`` fault the optimizers' step pre-hooks explain."""
    return (
        f"{CHANGED}, and the optimizer runs step pre-hooks before its update ({_listed(hooks)}): a hook that edits the "
        "gradient changes it at every step"
    )


def recurring_message(previous_step: int) -> str:
    """The words of a ``"modified"`` fault seen again (the applied check before this one had it too)."""
    return (
        f"{CHANGED}, as at the applied check of step {previous_step}: no one-off corruption but code that edits the "
        "gradient between the backward and the optimizer's update (a step pre-hook, a callback, the loop)"
    )


def recurring(report: CheckReport, previous: tuple[int, str | None] | None) -> CheckReport:
    """``report``, its ``"transient"`` fault called ``"modified"`` when the check before it (``previous``: its step and
    fault, for the same optimizer or window) found one of the two: a change at two checks in a row is no one-off."""
    if report.fault != "transient" or previous is None or previous[1] not in ("transient", "modified"):
        return report
    return report.with_findings(fault="modified", fault_message=recurring_message(previous[0]))
