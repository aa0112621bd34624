"""What a training loop lends a :class:`~gradwatch.watch.watch.GradientWatch`: where the records go (sinks), the
collective decisions and agreement of a distributed run (by default :mod:`.distributed`'s, which are the identity in
one process), a context around each check, and how it trains on an accumulation window (:class:`TrainingPath`)."""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from gradwatch.engine import CheckReport
from gradwatch.engine.applied.equivalence import Join
from gradwatch.engine.applied.window import Combine, PathContext
from gradwatch.errors import NoLossToCheckError as NoLossToCheckError

Decide = Callable[[int], int]
Agree = Callable[[CheckReport | None, Exception | None, int], CheckReport | None]
Context = Callable[[nn.Module], contextlib.AbstractContextManager[Any]]


@dataclasses.dataclass(frozen=True)
class TrainingPath:
    """How a loop turns the micro-batch losses of an accumulation window into the gradient it applies, for the applied
    check (:meth:`~gradwatch.GradientWatch.before_optimizer_step`): one object an adapter builds from what its loop
    knows, instead of four arguments. Its fields (``vars(path)``) are the keyword arguments of the same names and
    defaults of :func:`~gradwatch.engine.applied.check_applied_gradient`, documented there (the defaults: a plain loop
    that divides each loss by the number of micro-batches, its forward as it is)."""

    combine: Combine = "mean"
    path: PathContext | None = None
    join: Join | None = None
    window_normalised: bool | Callable[[], bool] = False


@contextlib.contextmanager
def local_batch_norm(module: nn.Module) -> Iterator[None]:
    """Let every ``SyncBatchNorm`` compute its statistics from this process's batch alone during a check.

    SyncBatchNorm runs collectives inside forward: synchronized probes would need every process to run exactly the same
    sequence of forwards, while each process's check takes its own data-dependent path (confirmations, retries). Its
    backward also returns, on each process, the gradient of the sum of all processes' losses, not of the local one. With
    local statistics each process checks a self-contained function of its own batch, and runs no collective."""
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
