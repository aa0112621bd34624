"""Checks of models whose parameters a parallelising library splits across ranks other than FSDP2's rows: DeepSpeed
ZeRO (:mod:`.zero`) and tensor parallelism (:mod:`.tensor_parallel`), run on the parameters made whole.

:func:`made_whole` is a step of opening a check's session: the model unwrapped and made whole for the check's duration,
an applied check's gradients made whole and keyed by the checked module's names, and its process group defaulting to
the one the library averages (ZeRO) or replicates (tensor parallelism) over.

For the update check, :func:`whole` and :func:`whole_value` gather one tensor whole (an FSDP2 ``DTensor``'s shards, a
ZeRO parameter's fp32 master partitions) and :func:`shares` says which elements of it each rank updates.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.engine.distributed import tensor_parallel, zero
from gradwatch.engine.results.notes import Note, NoteCode


def whole(tensor: Any) -> Any:
    """A ``DTensor``'s whole value (its shards gathered: a collective), anything else (a tensor, ``None``) itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") and hasattr(tensor, "placements") else tensor


def whole_value(param: Tensor) -> Tensor:
    """The whole tensor the optimizer updates for ``param``: a ZeRO parameter's fp32 master (DeepSpeed's
    ``get_full_hp_param``: the ranks' partitions gathered), a ``DTensor``'s shards gathered, else ``param``. A
    collective for either: every rank calls it together."""
    if hasattr(param, "_z3_optimizer"):  # ZeRO-3: the fp32 partitions of its ranks gathered
        return param._z3_optimizer.get_full_hp_param(param)  # type: ignore[no-any-return]
    if hasattr(param, "_hp_mapping") and hasattr(param, "get_full_hp_param"):
        return param.get_full_hp_param()  # type: ignore[no-any-return]
    return whole(param)  # type: ignore[no-any-return]


def whole_state(param: Tensor, flat: Tensor) -> Tensor:
    """``param``'s whole tensor of a ZeRO optimizer state entry ``flat`` (a tensor over the rank's flat fp32
    partition): each rank's fragment of it gathered, as DeepSpeed's ``get_full_hp_param`` gathers the state once it has
    linked it (after the first step); under ZeRO-3 the rank's partition of ``param``, at its offset in ``flat``. A
    collective: every rank calls it together."""
    z3 = getattr(param, "_z3_optimizer", None)
    if z3 is not None:
        _, offset, count = z3.grad_position[z3.get_param_id(param)]
        return z3._fp32_state_allgather(param, flat.detach().narrow(0, offset, count))  # type: ignore[no-any-return]
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
    owned, group = zero.owned_range(param), getattr(param, "_dp_group", getattr(param, "ds_process_group", None))
    if owned is None or not dist.is_initialized():
        return ()
    ranges = torch.zeros(dist.get_world_size(group), 2, dtype=torch.float64)
    ranges[dist.get_rank(group)] = torch.tensor(owned, dtype=torch.float64)
    dist.all_reduce(ranges, group=group)
    return tuple((int(start), int(count)) for start, count in ranges.tolist())


@dataclasses.dataclass
class Whole:
    """A check's model made whole (see the module doc): what a check of it runs on, and an applied check's gradients
    and process group as they follow from it.

    Attributes:
        model: The module the check runs on: the one a DeepSpeed engine wraps, its parameters whole while it runs.
        gradients: An applied check's gradients, whole and keyed by ``model``'s names (as given for a plain model).
        group: An applied check's process group: by default the one ZeRO averages or tensor parallelism replicates
            over (as given for a plain model).
        note: What the report says of it (ZeRO-3 parameters gathered, tensor-parallel parameters made plain).
    """

    model: nn.Module
    gradients: Any = None
    group: Any = None
    note: Note | None = None


@contextlib.contextmanager
def made_whole(model: nn.Module, gradients: Any = None, group: Any = None, *, applied: bool = False) -> Iterator[Whole]:
    """``model`` made whole for the duration, with an ``applied`` check's ``gradients`` and ``group`` (a recomputed
    check has neither: its gradients are not gathered nor its group looked up): a step of opening a check's session
    (:meth:`~gradwatch.engine.session.CheckSession.open`). A collective for a sharded model: every rank enters
    together."""
    is_zero = zero.is_engine(model) or any(zero.owned_range(p) is not None for p in model.parameters())
    is_tp = not is_zero and tensor_parallel.is_tensor_parallel(model)
    if not (is_zero or is_tp):
        yield Whole(model, gradients, group)
        return
    inner = zero.unwrapped(model)
    whole = Whole(inner, gradients, group)
    if applied:
        given = zero.unprefixed(gradients, model)
        whole.gradients = tensor_parallel.whole_gradients(inner, given) if is_tp else given
    if applied and group is None and dist.is_initialized():
        whole.group = zero.data_parallel_group(inner) if is_zero else tensor_parallel.mesh_group(inner)
    with contextlib.ExitStack() as stack:
        if is_tp:
            stack.enter_context(tensor_parallel.made_plain(inner))
            whole.note = Note(NoteCode.TENSOR_PARALLEL, tensor_parallel.TENSOR_PARALLEL_NOTE)
        elif stack.enter_context(zero.gathered(inner)):
            whole.note = Note(NoteCode.ZERO3_GATHERED, zero.ZERO3_NOTE)
        yield whole
