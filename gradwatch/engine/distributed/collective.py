"""The reductions of a sharded check, and how its ranks stay in lockstep.

Every forward pass of a sharded model runs collectives (FSDP gathers each unit's parameters), so all ranks must run
the same evaluations in the same order. The engine decides only on numbers that are the same on every rank: each sum
over parameters is a local partial sum reduced with :func:`summed`, each loss the ranks' mean (:func:`global_loss`).

What no decision can foresee is the user's code raising on one rank only. Every collective a rank can be waiting at
inside an evaluation is a 2-element ``[value, failures]`` all-reduce (the loss at its end, and a :func:`peers_ok`
before each FSDP unit gathers its parameters, installed by :mod:`.parameters`); a rank whose evaluation raises sends
``[nan, 1]`` instead (:func:`evaluation`), so whichever reduction the others are at reads a failure and every rank
raises :class:`PeerFailureError`, ending the check everywhere (where every rank's evaluation raised, each raises its own
error, and the engine's fallbacks run alike on all). A reduction that does not complete within
:data:`REDUCTION_TIMEOUT_S` ends the check the same way rather than hang the run.
"""

from __future__ import annotations

import contextlib
import datetime
import math
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gradwatch.engine.results.report import CheckAbandonedError
from gradwatch.errors import PeerFailureError

REDUCTION_TIMEOUT_S = 300.0
"""How long a rank waits at one of the check's reductions before it ends the check (every rank runs the same
evaluations, so a wait longer than one evaluation means a rank is stuck or gone)."""


@dataclass(frozen=True)
class Layout:
    """Where a rank's shard of a parameter (``Shard(0)``) sits in the whole: rows ``offset`` to ``offset + rows`` of a
    tensor of ``global_shape``."""

    global_shape: torch.Size
    offset: int
    rows: int

    def local_index(self, index: tuple[int, ...]) -> tuple[int, ...] | None:
        """The index in the shard of the global coordinate ``index``; ``None`` if another rank holds it."""
        if not index or not self.offset <= index[0] < self.offset + self.rows:
            return None
        return (index[0] - self.offset, *index[1:])


@dataclass
class Collective:
    """The ranks of a sharded check: their process group, and the layout of every local shard the check moves (keyed
    by ``id`` of the local tensor: shards, their gradients, masks over them)."""

    group: dist.ProcessGroup
    world: int
    rank: int
    layouts: dict[int, Layout] = field(default_factory=dict)
    parameters: dict[int, torch.Tensor] = field(default_factory=dict)
    """The sharded parameter (``DTensor``) of each local shard, by ``id`` of the shard."""

    def reduce(self, values: Sequence[float]) -> list[float]:
        """The sums of ``values`` over the ranks, in float64, the same on every rank."""
        tensor = torch.tensor(list(values), dtype=torch.float64)
        try:
            work = dist.all_reduce(tensor, group=self.group, async_op=True)
            assert work is not None
            completed = work.wait(timeout=datetime.timedelta(seconds=REDUCTION_TIMEOUT_S))
        except RuntimeError as error:
            raise PeerFailureError(f"a reduction across the {self.world} ranks failed ({error})") from error
        if completed is False:
            raise PeerFailureError(f"a reduction across the {self.world} ranks took over {REDUCTION_TIMEOUT_S:g} s")
        return tensor.tolist()

    def flagged(self, value: float, failed: bool) -> float:
        """The sum of ``value`` over the ranks; raises :class:`PeerFailureError` if any rank (this one if ``failed``)
        reports a failure."""
        total, failures = self.reduce([value, 1.0 if failed else 0.0])
        if failures:
            raise PeerFailureError(f"the evaluation raised on {int(failures)} of the {self.world} ranks")
        return total


_ACTIVE: ContextVar[Collective | None] = ContextVar("gradwatch_collective", default=None)


def active() -> Collective | None:
    """The collective of the sharded check running in this context, if any."""
    return _ACTIVE.get()


@contextlib.contextmanager
def sharded(collective: Collective | None) -> Iterator[None]:
    """Run the engine's reductions across ``collective``'s ranks for the duration (nothing changes with ``None``)."""
    token = _ACTIVE.set(collective)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def summed(values: Sequence[float]) -> list[float]:
    """``values`` summed over the ranks of a sharded check (one reduction); unchanged outside one."""
    collective = _ACTIVE.get()
    if collective is None or not values:
        return list(values)
    return collective.reduce(values)


def any_rank(flags: Sequence[bool]) -> list[bool]:
    """Each flag, true if it is true on any rank."""
    return [total > 0 for total in summed([1.0 if flag else 0.0 for flag in flags])]


def every_rank(flags: Sequence[bool]) -> list[bool]:
    """Each flag, true if it is true on every rank."""
    return [not flag for flag in any_rank([not flag for flag in flags])]


def global_loss(value: float) -> float:
    """The loss of a sharded check: the mean of the ranks' losses (FSDP averages the gradient alike); ``value``
    outside one. Raises :class:`PeerFailureError` if another rank's evaluation failed."""
    collective = _ACTIVE.get()
    if collective is None:
        return value
    return collective.flagged(value, failed=False) / collective.world


def peers_ok() -> None:
    """Raise :class:`PeerFailureError` if another rank's evaluation failed (a no-op outside a sharded check)."""
    collective = _ACTIVE.get()
    if collective is not None:
        collective.flagged(0.0, failed=False)


@contextlib.contextmanager
def evaluation() -> Iterator[None]:
    """One evaluation of the loss: if it raises here, the other ranks learn of it at their next reduction and all end
    the check together (this rank raises :class:`PeerFailureError` from the error)."""
    collective = _ACTIVE.get()
    if collective is None:
        yield
        return
    try:
        yield
    except CheckAbandonedError:
        raise
    except Exception as error:
        message = f"the evaluation raised {type(error).__name__} on rank {collective.rank} ({error})"
        try:
            _, failures = collective.reduce([math.nan, 1.0])
        except PeerFailureError as failure:
            raise PeerFailureError(f"{message}; {failure}") from error
        if failures >= collective.world:
            raise  # the same on every rank: the engine's fallbacks (a larger slice, no input probes) run alike
        raise PeerFailureError(message) from error


def layout(tensor: torch.Tensor) -> Layout | None:
    """The layout of a shard the sharded check registered (``None`` for any other tensor, or outside one)."""
    collective = _ACTIVE.get()
    return None if collective is None else collective.layouts.get(id(tensor))


def global_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape of the whole tensor ``tensor`` is a shard of (its own shape if it is not one)."""
    found = layout(tensor)
    return tensor.shape if found is None else found.global_shape


def global_numel(tensor: torch.Tensor) -> int:
    """The number of elements of the whole tensor ``tensor`` is a shard of."""
    return math.prod(global_shape(tensor))


def global_index(tensor: torch.Tensor, local: tuple[int, ...]) -> tuple[int, ...]:
    """The global index of element ``local`` of ``tensor`` (itself, if ``tensor`` is not a shard)."""
    found = layout(tensor)
    return local if found is None or not local else (local[0] + found.offset, *local[1:])


def value_at(tensor: torch.Tensor, index: tuple[int, ...]) -> float:
    """The element at global ``index`` of the whole tensor ``tensor`` is a shard of, on every rank."""
    found = layout(tensor)
    if found is None:
        return float(tensor[index])
    local = found.local_index(index)
    return summed([float(tensor[local]) if local is not None else 0.0])[0]
