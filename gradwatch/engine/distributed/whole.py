"""Checks of models whose parameters a parallelising library splits across ranks other than FSDP2's rows: DeepSpeed
ZeRO (:mod:`.zero`) and tensor parallelism (:mod:`.tensor_parallel`), run on the parameters made whole.

:func:`on_whole_parameters` adapts a check function (:func:`~gradwatch.check_gradients`,
:func:`~gradwatch.check_applied_gradient`): its model argument unwrapped, made whole for the duration, the applied
gradients given made whole and keyed by the checked module's names, and the process group of an applied check
defaulting to the one the library averages (ZeRO) or replicates (tensor parallelism) over.

For the update check, :func:`whole` and :func:`whole_value` gather one tensor whole (an FSDP2 ``DTensor``'s shards, a
ZeRO-1/2 parameter's fp32 master partitions) and :func:`shares` says which elements of it each rank updates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.engine.distributed import tensor_parallel, zero
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import CheckReport

Options = ParamSpec("Options")


def whole(tensor: Any) -> Any:
    """A ``DTensor``'s whole value (its shards gathered: a collective), anything else (a tensor, ``None``) itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") and hasattr(tensor, "placements") else tensor


def whole_value(param: Tensor) -> Tensor:
    """The whole tensor the optimizer updates for ``param``: a ZeRO-1/2 parameter's fp32 master (DeepSpeed's
    ``get_full_hp_param``: the ranks' partitions gathered), a ``DTensor``'s shards gathered, else ``param``. A
    collective for either: every rank calls it together."""
    if hasattr(param, "_hp_mapping") and hasattr(param, "get_full_hp_param"):
        return param.get_full_hp_param()  # type: ignore[no-any-return]
    return whole(param)  # type: ignore[no-any-return]


def whole_state(param: Tensor, flat: Tensor) -> Tensor:
    """``param``'s whole tensor of a ZeRO-1/2 optimizer state entry ``flat`` (a tensor over the rank's flat fp32
    partition): each rank's fragment of it gathered, as DeepSpeed's ``get_full_hp_param`` gathers the state once it has
    linked it (after the first step). A collective: every rank calls it together."""
    gathered = torch.zeros(param.numel(), dtype=flat.dtype)
    mapping = param._hp_mapping  # type: ignore[attr-defined]
    if mapping is not None:
        lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
        gathered.narrow(0, lp.start, lp.numel).copy_(flat.detach().reshape(-1).narrow(0, hp.start, hp.numel))
    dist.all_reduce(gathered, group=param._dp_group)  # type: ignore[attr-defined]
    return gathered.reshape(param.shape)


def shares(param: Tensor) -> tuple[tuple[int, int], ...]:
    """By rank, ``(start, count)``: the elements of the flattened ``param`` whose update that rank makes (FSDP2's rows
    of a ``Shard(0)`` DTensor, the ranges ZeRO partitions it into); ``()`` for a parameter every rank updates whole.
    Under ZeRO a collective: every rank calls it together."""
    if hasattr(param, "placements") and [repr(x) for x in param.placements] == ["Shard(dim=0)"] and param.dim():
        world, rows = param.device_mesh.size(), param.shape[0]  # type: ignore[attr-defined]
        chunk, row = -(-rows // world), param.numel() // max(rows, 1)  # rows split as torch.chunk splits them
        return tuple((min(r * chunk, rows) * row, max(0, min(chunk, rows - r * chunk)) * row) for r in range(world))
    owned, group = zero.owned_range(param), getattr(param, "_dp_group", None)
    if owned is None or not dist.is_initialized():
        return ()
    ranges = torch.zeros(dist.get_world_size(group), 2, dtype=torch.float64)
    ranges[dist.get_rank(group)] = torch.tensor(owned, dtype=torch.float64)
    dist.all_reduce(ranges, group=group)
    return tuple((int(start), int(count)) for start, count in ranges.tolist())


def on_whole_parameters(check: Callable[Options, CheckReport]) -> Callable[Options, CheckReport]:
    """Make a check of a model (its first argument) take DeepSpeed and tensor-parallel models (see the module doc)."""
    takes_group = "group" in inspect.signature(check).parameters

    @functools.wraps(check)
    def run(*args: Options.args, **kwargs: Options.kwargs) -> CheckReport:
        values: list[Any] = list(args)
        model = values[0] if values else kwargs.get("model")
        if not isinstance(model, nn.Module):
            return check(*args, **kwargs)
        is_zero = zero.is_engine(model) or any(zero.owned_range(p) is not None for p in model.parameters())
        is_tp = not is_zero and tensor_parallel.is_tensor_parallel(model)
        if not (is_zero or is_tp):
            return check(*args, **kwargs)
        inner = zero.unwrapped(model)
        values[0:1] = [inner] if values else []
        if "model" in kwargs:
            kwargs["model"] = inner
        if takes_group:  # an applied check: its gradients, whole and by the checked module's names
            given = zero.unprefixed(values[3] if len(values) > 3 else kwargs.get("gradients"), model)
            if is_tp:
                given = tensor_parallel.whole_gradients(inner, given)
            if len(values) > 3:
                values[3] = given
            else:
                kwargs["gradients"] = given
            if kwargs.get("group") is None and dist.is_initialized():
                kwargs["group"] = zero.data_parallel_group(inner) if is_zero else tensor_parallel.mesh_group(inner)
        note: Note | None = None
        with contextlib.ExitStack() as stack:
            if is_tp:
                stack.enter_context(tensor_parallel.made_plain(inner))
                note = Note(NoteCode.TENSOR_PARALLEL, tensor_parallel.TENSOR_PARALLEL_NOTE)
            else:
                note = (
                    Note(NoteCode.ZERO3_GATHERED, zero.ZERO3_NOTE)
                    if stack.enter_context(zero.gathered(inner))
                    else None
                )
            report = check(*values, **kwargs)
        return report if note is None else dataclasses.replace(report, notes=[*report.notes, note])

    return run
