"""The applied gradient of a sharded model (FSDP2's ``fully_shard``): each rank checks its shard of it, together.

After FSDP's reduce-scatter each rank holds, as ``param.grad``, its rows of one gradient of the global loss (the mean
of the ranks' window losses). Its applied check is a sharded check (:mod:`gradwatch.engine.distributed`): every rank
moves its own shards along its rows of the applied gradient, every number a probe decides on is summed over the ranks,
and all ranks run the same evaluations in the same order (the collectives of FSDP's forward need it). There is no
cross-rank checksum to compare; when a probe fails, the ranks whose rows disagree with the same rows recomputed on the
training's path are named (:func:`ranks_at_fault`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradwatch.engine.distributed import SHARDED_NOTE
from gradwatch.engine.distributed.collective import Collective, sharded
from gradwatch.engine.distributed.parameters import register_like
from gradwatch.engine.numerics.norms import norms

__all__ = ["ShardedWindow", "ranks_at_fault", "shard_window"]


@dataclass
class ShardedWindow:
    """A sharded applied check's collective, the local shards it moves and this rank's rows of the applied gradient."""

    collective: Collective
    params: list[Tensor]
    applied: list[Tensor]

    def note(self) -> str:
        return (
            f"{SHARDED_NOTE} {self.collective.world} ranks: the applied gradient as FSDP reduce-scattered it, each "
            "rank its own rows, against the global loss (the mean of the ranks' window losses); recomputations go "
            "through FSDP's own reduce-scatter, so a fault of the reduction reads as the path's"
        )

    def finite(self) -> bool:
        """Whether every rank's rows of the applied gradient are finite (the same answer on every rank)."""
        local = all(bool(torch.isfinite(g).all()) for g in self.applied)
        return not self.collective.reduce([0.0 if local else 1.0])[0]


def shard_window(collective: Collective, local: Sequence[Tensor], applied: Sequence[Tensor]) -> ShardedWindow:
    """This rank's rows of the ``applied`` gradients (``DTensor``\\ s, or local tensors already) of the parameters
    whose local shards are ``local`` (the check's session found them and their ``collective``)."""
    rows = []
    for grad, shard in zip(applied, local, strict=True):
        mine = grad.to_local() if hasattr(grad, "to_local") else grad
        rows.append(register_like(collective, mine.detach(), shard))
    return ShardedWindow(collective, list(local), rows)


def ranks_at_fault(
    collective: Collective, applied: Sequence[Tensor], recomputed: Sequence[Tensor], floors: Sequence[float]
) -> list[int]:
    """The ranks whose rows of the applied gradient are farther from the same rows ``recomputed`` than the path's
    floor allows them (each tensor's ``floors`` entry is for the whole tensor; a rank's rows may take all of it)."""
    mine = [a.double() - r.double() for a, r in zip(applied, recomputed, strict=True)]
    with sharded(None):  # this rank's rows alone
        distances = norms(mine, exact=True)
    local = any(d > f and math.isfinite(f) for d, f in zip(distances, floors, strict=True))
    flags = [0.0] * collective.world
    flags[collective.rank] = 1.0 if local else 0.0
    return [rank for rank, flag in enumerate(collective.reduce(flags)) if flag]
