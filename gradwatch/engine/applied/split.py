"""The applied check of a model whose ranks hold different parameters: split by hand (:func:`split_window`), or sharded
by FSDP2's ``fully_shard`` (:func:`shard_window`).

Ranks that hold different parameters without a library that says how (hand-written tensor or pipeline parallelism,
:func:`~.window.ranks_with_other_parameters`) train one function: the sum ``S`` of the ranks' losses. Each rank's
backward computes ``∂S/∂θ_r`` for its own parameters when the loss's collectives have their adjoints as backward
(``torch.distributed.nn``'s all-reduce), or when the loss has none. No rank's loss alone is that function, and the
ranks' gradients are no copies of one reduced gradient to compare.

The applied check of DDP replicas already evaluates a loss with collectives on every rank in lockstep, against the
mean of the ranks' losses. A split model is made such replicas for the check: on every rank a :class:`SplitModel` holds
every rank's part under ``rank.<r>``, its own the module itself and the others' a copy of their parameters and
gradients (one gather), which the probes move as the owner moves the real ones and its forward never uses. Each rank's
loss is scaled by the number of ranks, so the mean is ``S``. A probe of one tensor moves it on its owner alone, and a
failing one names the rank (``rank.1.0.weight``). A recomputed gradient is each rank's own, zero on the copies,
averaged as DDP averages: ``∂S/∂θ_r`` again. Where every rank computes the same loss ``L`` (tensor parallelism),
Megatron's convention (the forward's all-reduce with an identity backward) trains ``∂L/∂θ_r = ∂S/∂θ_r / world``: a
gradient wrong for ``S`` is then checked against ``L`` too (:func:`~.check.check_applied_gradient` keeps the convention
more of its tensors agree with). The cost: every rank holds every rank's checked parameters and gradients (fine for
the small models split by hand; a large one wants DTensor or FSDP2).

**Sharded**: after FSDP's reduce-scatter each rank holds, as ``param.grad``, its rows of one gradient of the global loss
(the mean of the ranks' window losses). Its applied check is a sharded check (:mod:`gradwatch.engine.distributed`):
every rank moves its own shards along its rows of the applied gradient, every number a probe decides on is summed over
the ranks, and all ranks run the same evaluations in the same order (the collectives of FSDP's forward need it). There
is no cross-rank checksum to compare; when a probe fails, the ranks whose rows disagree with the same rows recomputed
on the training's path are named (:func:`ranks_at_fault`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.engine.distributed import SHARDED_NOTE
from gradwatch.engine.distributed.collective import Collective, sharded
from gradwatch.engine.distributed.parameters import register_like
from gradwatch.engine.function.evaluation import LossFn
from gradwatch.engine.function.values import as_scalar_loss
from gradwatch.engine.numerics.norms import norms


class SplitModel(nn.Module):
    """Every rank's part of a model split by hand: ``rank[r]`` this rank's own module, or a copy of rank ``r``'s checked
    parameters."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.rank = nn.ModuleList(parts)


def _copy(named: Sequence[tuple[str, Tensor]], device: torch.device) -> nn.Module:
    """A module holding ``named`` parameters (copies on ``device``) under their own dotted names."""
    shell = nn.Module()
    for name, value in named:
        *path, leaf = name.split(".")
        module = shell
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]  # type: ignore[assignment]
        module.register_parameter(leaf, nn.Parameter(value.to(device), requires_grad=True))
    return shell


@dataclasses.dataclass
class SplitWindow:
    """A split model's check as replicas: the :class:`SplitModel`, every rank's gradients by their names there, the
    user's loss and this rank's part, and the first value of this rank's own loss at the point."""

    model: SplitModel
    gradients: dict[str, Tensor]
    loss_fn: LossFn
    part: nn.Module
    world: int
    first: list[float] = dataclasses.field(default_factory=list)

    def loss(self, scale: float) -> LossFn:
        """This rank's loss times ``scale`` (the number of ranks: the mean of the ranks' losses is their sum)."""

        def scaled(_: nn.Module, batch: Any) -> Tensor:
            value = as_scalar_loss(self.loss_fn(self.part, batch))
            if not self.first:
                self.first.append(float(value.detach()))
            return value * scale

        return scaled

    def replicated(self, group: Any) -> bool:
        """Whether every rank's loss had the same value at the point (a collective)."""
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, self.first[:1], group=group)
        return all(found == every[0] and found for found in every)


def split_window(
    model: nn.Module, loss_fn: LossFn, names: Sequence[str], applied: Sequence[Tensor], group: Any
) -> SplitWindow:
    """A split model's check as replicas: ``model`` this rank's part, ``names`` its checked parameters and ``applied``
    their gradients (complex ones as their real views). One gather over ``group``."""
    params = dict(model.named_parameters())
    gradients = [torch.view_as_complex(g) if params[n].is_complex() else g for n, g in zip(names, applied, strict=True)]
    mine = [(name, params[name].detach().cpu(), g.detach().cpu()) for name, g in zip(names, gradients, strict=True)]
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    here = dist.get_rank(group)
    device = next(iter(params.values())).device if params else torch.device("cpu")
    parts = [model if r == here else _copy([(n, p) for n, p, _ in held], device) for r, held in enumerate(every)]
    found = {f"rank.{r}.{n}": g.to(device) for r, held in enumerate(every) if r != here for n, _, g in held}
    found.update({f"rank.{here}.{n}": g for n, g in zip(names, gradients, strict=True)})  # its own, bit for bit
    return SplitWindow(SplitModel(parts), found, loss_fn, model, len(every))


def split_note(ranks: list[int], world: int) -> str:
    """The words of the check of a model whose ``ranks`` hold other parameters than rank 0."""
    return (
        f"rank(s) {ranks} hold other parameters than rank 0 (their names or shapes differ): the model is split across "
        "the ranks by hand (hand-written tensor or pipeline parallelism), not replicated as under DDP, so it was "
        f"checked as one model of every rank's parameters (named rank.<r>.<name>) against the sum of the {world} "
        "ranks' losses, every rank evaluating it together at the same points and moving its own parameters; each "
        "rank's gradient is taken for the derivative of that sum (what autograd collectives give)"
    )


def replicated_note(world: int) -> str:
    """The words of a split model's gradient checked against the loss every rank computes alike."""
    return (
        f"every rank computes the same loss, and the gradient is not that of the {world} ranks' sum but of that loss "
        "(one rank's copy): the convention of tensor parallelism written as Megatron's (the forward's all-reduce "
        "with an identity backward); checked against it"
    )


@dataclasses.dataclass
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
