"""A tensor-parallel recomputed check's two guards: a loss written for the shards
(:func:`refusing_losses_written_for_shards`) and replicas that disagree (:func:`disagreeing_replicas`).

A recomputed check of a tensor-parallel model differentiates the loss with the parameters made whole on every rank
(:mod:`gradwatch.engine.distributed.tensor_parallel`). That is the training's loss only if the loss does not depend on
how the parameters are laid out. A loss written for the shards does: a vocab-parallel cross-entropy (Megatron-LM's)
takes each rank's slice of the logits and all-reduces the maximum, the sum of exponentials and the target's logit over
the group; on whole logits every rank counts the whole vocabulary, so the ranks compute another loss than training's,
and different gradients of the replicated parameters, although training's gradient is right. Checked on whole
parameters, such a loss would fail a correct model.

So before a tensor-parallel recomputed check the loss is evaluated on the shards, as training computes it, and on the
whole parameters, every rank together, the random state replayed and the model's state put back; where the two differ
beyond rounding the report is ``"inconclusive"`` with a note (``loss-for-shards``) saying why and what checks such a
loss instead (the applied check). A model that FSDP2 shards as well (a 2-D mesh) is not compared.

The model's own collectives (Megatron-style autograd functions that scatter rows, gather them, or sum a replicated
parameter's gradient across the group) may still run in its forward and backward, and ranks stay in lockstep only
while they take the same decisions. So after the reference every rank compares its parameters and gradient with the
other ranks that hold the same batch: a tensor whose gradient norm differs between them by more than the check's
tolerance fails on all of them (at least one of them is not the derivative); so does a parameter whose values differ
(a replicated parameter is updated alike on every rank of its group unless the gradients training applied to it
differed: a reduction missed on some rank at an earlier step). Either way every rank of the group stops probing
together; ranks that agree go on.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.engine.distributed import tensor_parallel, zero
from gradwatch.engine.distributed.tensor_parallel import replicas_group
from gradwatch.engine.function.batch import ROOT, map_tensors
from gradwatch.engine.function.state import TrainingState
from gradwatch.engine.function.values import as_scalar_loss
from gradwatch.engine.results.kinds import ProbeKind, Reason, Verdict
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import CheckReport, Probe
from gradwatch.errors import passes_fallbacks

__all__ = ["SAME_LOSS", "disagreeing_replicas", "refusing_losses_written_for_shards"]

Options = ParamSpec("Options")

SAME_LOSS = 1e-5
"""How far, relatively, the loss on whole parameters may be from the loss on the shards: the collectives and the whole
matmuls sum in another order (float32 rounding, ~1e-7), a loss written for the shards is off by O(1) (``log n``)."""


def _value(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any]) -> float:
    """``loss_fn(model, batch)`` without a gradient, the random state replayed and the model's state put back after."""
    state = TrainingState.capture(model)
    try:
        state.before_evaluation()
        with torch.no_grad():
            value = as_scalar_loss(loss_fn(model, batch))
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        state.after_evaluation()
        return float(value.detach().double())
    finally:
        state.restore()


def _fully_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards the model too (a 2-D mesh), whose hooks run a forward on the shards only within a training
    step: not compared."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        return False
    return any(isinstance(module, FSDPModule) for module in model.modules())


def refusing_losses_written_for_shards(check: Callable[Options, CheckReport]) -> Callable[Options, CheckReport]:
    """Make a recomputed check (``check(model, batch, loss_fn, ..., step=...)``) of a tensor-parallel model refuse a
    loss that computes another value on whole parameters than on the shards (see the module doc); every other model
    goes to ``check`` untouched."""
    signature = inspect.signature(check)

    @functools.wraps(check)
    def run(*args: Options.args, **kwargs: Options.kwargs) -> CheckReport:
        bound = signature.bind_partial(*args, **kwargs)
        model, batch, loss_fn = (bound.arguments.get(name) for name in ("model", "batch", "loss_fn"))
        if not (
            dist.is_initialized()
            and isinstance(model, nn.Module)
            and callable(loss_fn)
            and not zero.is_engine(model)
            and tensor_parallel.is_tensor_parallel(model)
            and not _fully_sharded(model)
        ):
            return check(*args, **kwargs)
        started = time.perf_counter()
        try:
            on_shards = _value(model, batch, loss_fn)
        except Exception as error:  # the loss does not run on these shards: nothing to compare with
            if passes_fallbacks(error):
                raise
            return check(*args, **kwargs)
        # one gather of the whole parameters serves the comparison and the check
        with tensor_parallel.made_plain(model):
            on_whole = _value(model, batch, loss_fn)
            if math.isfinite(on_shards) and abs(on_whole - on_shards) <= SAME_LOSS * max(abs(on_shards), 1e-30):
                report = check(*args, **kwargs)  # on plain parameters now: the check makes nothing whole again
                note = Note(NoteCode.TENSOR_PARALLEL, tensor_parallel.TENSOR_PARALLEL_NOTE)
                return dataclasses.replace(report, notes=[*report.notes, note])
        text = (
            f"no probe made: on whole parameters the loss is {on_whole:.9g}, on the shards (as training computes it) "
            f"{on_shards:.9g}; it is written for the shards (a vocab-parallel cross-entropy, a loss that all-reduces "
            "over the tensor-parallel group), so its derivative with whole parameters is not the training's. The "
            "applied check compares the training's own gradient with this loss's derivative"
        )
        return CheckReport(
            step=int(bound.arguments.get("step", 0) or 0), verdict=Verdict.INCONCLUSIVE, probes=[], loss=on_shards,
            n_forward=2, n_backward=0, duration_s=time.perf_counter() - started,
            notes=[Note(NoteCode.LOSS_FOR_SHARDS, text)],
        )  # fmt: skip

    return run


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
