"""What a training loop lends a :class:`~gradwatch.watch.watch.GradientWatch`: where the records go (sinks), the
collective decisions and agreement of a distributed run, and a context around each check. The defaults suit one
process of a plain loop."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import nn

from gradwatch.engine import CheckReport


class NoLossToCheckError(Exception):
    """Raised by a ``loss_fn`` that has no loss for this batch (a ``training_step`` that returned ``None``): the check
    is skipped, silently."""


Decide = Callable[[int], int]
Agree = Callable[[CheckReport | None, Exception | None, int], CheckReport | None]
Context = Callable[[nn.Module], contextlib.AbstractContextManager[Any]]


def no_context(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """The default context around a check: none."""
    return contextlib.nullcontext()


def as_decided(wait: int) -> int:
    """The default budget decision: this process's proposal (one process decides for itself)."""
    return wait
