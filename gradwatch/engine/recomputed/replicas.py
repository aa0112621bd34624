"""The replicas of a tensor-parallel check: ranks that compute the same loss on the same batch at the same (whole)
parameters must compute the same gradient.

Under tensor parallelism a recomputed check runs on every rank with the model made whole
(:mod:`gradwatch.engine.distributed.tensor_parallel`), and a model's own collectives (Megatron-style autograd functions
that scatter rows, gather them, or sum a replicated parameter's gradient across the group) may still run in its forward
and backward. Ranks stay in lockstep only while they take the same decisions, so after the reference every rank
compares its parameters and gradient with the other ranks that hold the same batch:

* a tensor whose gradient norm differs between them by more than the check's tolerance fails on all of them (at least
  one of them is not the derivative);
* a parameter whose values differ fails too: a replicated parameter is updated alike on every rank of its group unless
  the gradients training applied to it differed (a reduction missed on some rank at an earlier step).

Either way every rank of the group stops probing together; ranks that agree go on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor

from gradwatch.engine.distributed.tensor_parallel import replicas_group
from gradwatch.engine.function.batch import ROOT, map_tensors
from gradwatch.engine.results.kinds import ProbeKind, Reason, Verdict
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import Probe

_Sums = tuple[float, float, float]


def _sums(tensor: Tensor) -> _Sums:
    """The float64 sum, sum of absolute values and sum of squares of ``tensor``."""
    flat = tensor.detach().reshape(-1).double()
    return float(flat.sum()), float(flat.abs().sum()), float(flat.square().sum())


def _fingerprint(batch: Any) -> tuple[_Sums, ...]:
    """:func:`_sums` of every tensor of ``batch``, in traversal order."""
    rows: list[_Sums] = []

    def add(_: str, tensor: Tensor) -> Tensor:
        rows.append(_sums(tensor))
        return tensor

    map_tensors(batch, ROOT, add)
    return tuple(rows)


def _differs(mine: float, theirs: float, rtol: float) -> bool:
    return not math.isfinite(mine - theirs) or abs(mine - theirs) > rtol * max(abs(mine), abs(theirs))


def disagreeing_replicas(
    batch: Any, params: Sequence[tuple[str, Tensor]], sizes: Sequence[float], rtol: float, notes: list[Note]
) -> list[Probe]:
    """Inside a tensor-parallel check, a failing probe for each parameter whose values differ, or whose gradient norm
    (``sizes``) differs beyond ``rtol`` (relative), between the ranks that hold the same ``batch`` as this one, with a
    note naming those ranks; ``[]`` elsewhere, and where they agree. A collective over every rank of the model's
    mesh."""
    group = replicas_group()
    if group is None:
        return []
    mine = (_fingerprint(batch), [_sums(p) for _, p in params], [float(size) for size in sizes])
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    replicas = [rank for rank, (fingerprint, _, _) in enumerate(every) if fingerprint == mine[0]]
    _, first_values, first_sizes = every[replicas[0]]
    probes: list[Probe] = []
    ranks: set[int] = set()
    for i, (name, _) in enumerate(params):
        values = [rank for rank in replicas[1:] if every[rank][1][i] != first_values[i]]
        grads = [rank for rank in replicas[1:] if _differs(every[rank][2][i], first_sizes[i], rtol)]
        if values or grads:
            ranks.update(values + grads)
            own, theirs = mine[2][i], first_sizes[i]
            error = (
                abs(own - theirs) / max(abs(own), abs(theirs), math.ulp(0.0))
                if math.isfinite(own - theirs)
                else math.inf
            )
            probes.append(Probe(ProbeKind.TENSOR, name, None, own, theirs, error, verdict=Verdict.FAIL, noise=math.nan,
                                step=0.0, reason=Reason.DISCREPANCY))  # fmt: skip
    if probes:
        shown = ", ".join(p.target for p in probes[:6]) + (f" and {len(probes) - 6} more" if len(probes) > 6 else "")
        notes.append(Note(NoteCode.REPLICAS_DISAGREE, (
            f"no probe made: rank(s) {sorted(ranks)} hold other values or compute another gradient (norms more "
            f"than {rtol:.2g} apart) of {shown} than rank {replicas[0]}, on the same batch (tensor parallel: a "
            "replicated parameter is updated alike on every rank of its group unless its gradients "
            "differed)")))  # fmt: skip
    return probes
