"""Checks of sharded models (FSDP2's ``fully_shard``: parameters as ``DTensor`` shards over a 1-D device mesh).

Under sharding the function checked is the global loss, the mean of every rank's local loss, which the gradient FSDP
leaves on the shards differentiates. Each rank moves its own shard of every parameter (and its own inputs) along one
global direction, and every number a probe decides on is summed across the ranks before anyone decides, so that all
ranks run the same evaluations in the same order (:mod:`.collective`: the reductions, and the protocol that ends a check
on every rank together when one rank's evaluation raises or a reduction times out; :mod:`.parameters`: the sharded
parameters, their local shards, the global index of a coordinate and the rank that holds it). Outside a sharded check
every function here is the identity, so the rest of the engine calls them unconditionally.

A check that runs a model as a plain module (its parameters whole on every rank: ZeRO-3, tensor parallelism) sets aside
the parallelising library's module hooks (:func:`hooks_set_aside`), which gather, release or redistribute in them; the
user's hooks run as before.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from torch import nn

SHARDED_NOTE = "sharded check across"
"""How the note of every sharded check's report begins."""

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
