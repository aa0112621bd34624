"""Module hooks of a parallelising library, set aside for the duration of a check and put back as they were.

DeepSpeed ZeRO-3 gathers and releases parameters in module hooks, tensor parallelism redistributes inputs and outputs
in them. A check that runs such a model as a plain module (its parameters whole on every rank) sets them aside; the
other hooks (the user's) run as before.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from torch import nn

_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def defined_in(hook: Any, package: str) -> bool:
    """Whether ``hook`` (or the function it wraps) is defined in ``package`` or a module below it."""
    module = getattr(inspect.unwrap(hook), "__module__", None) or ""
    return module == package or module.startswith(package + ".")


@contextlib.contextmanager
def hooks_set_aside(model: nn.Module, package: str) -> Iterator[None]:
    """For the duration, ``model``'s modules run without the hooks defined in ``package``; the very hook dictionaries
    are put back afterwards (in their order, with their handles)."""
    saved: list[tuple[nn.Module, str, Any]] = []
    for module in model.modules():
        for attribute in _HOOKS:
            hooks = module.__dict__.get(attribute)
            if hooks and any(defined_in(hook, package) for hook in hooks.values()):
                saved.append((module, attribute, hooks))
                kept = OrderedDict((key, hook) for key, hook in hooks.items() if not defined_in(hook, package))
                module.__dict__[attribute] = kept
    try:
        yield
    finally:
        for module, attribute, hooks in saved:
            module.__dict__[attribute] = hooks
