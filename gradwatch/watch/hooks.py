"""What a training loop lends a :class:`~gradwatch.watch.watch.GradientWatch`: where the records go (sinks), the
collective decisions and agreement of a distributed run, and a context around each check. The defaults suit one
process of a plain loop."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from gradwatch.engine import CheckReport
from gradwatch.errors import NoLossToCheckError as NoLossToCheckError

Decide = Callable[[int], int]
Agree = Callable[[CheckReport | None, Exception | None, int], CheckReport | None]
Context = Callable[[nn.Module], contextlib.AbstractContextManager[Any]]


def no_context(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """The default context around a check: none."""
    return contextlib.nullcontext()


def as_decided(wait: int) -> int:
    """The default budget decision: this process's proposal (one process decides for itself)."""
    return wait


@contextlib.contextmanager
def local_batch_norm(module: nn.Module) -> Iterator[None]:
    """Let every ``SyncBatchNorm`` compute its statistics from this process's batch alone during a check.

    SyncBatchNorm runs collectives inside forward: synchronized probes would need every process to run exactly the same
    sequence of forwards, while each process's check takes its own data-dependent path (confirmations, retries). Its
    backward also returns, on each process, the gradient of the sum of all processes' losses, not of the local one.
    With local statistics each process checks a self-contained function of its own batch, and runs no collective.
    """
    patched = [m for m in module.modules() if isinstance(m, nn.SyncBatchNorm)]
    saved = [m.__dict__.get("forward") for m in patched]
    for m in patched:
        m.forward = types.MethodType(nn.BatchNorm1d.forward, m)  # type: ignore[method-assign]  # local statistics
    try:
        yield
    finally:
        for m, forward in zip(patched, saved, strict=True):
            if forward is None:
                del m.forward
            else:
                m.forward = forward  # type: ignore[method-assign]
