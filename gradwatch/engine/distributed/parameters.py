"""Sharded parameters: which a model has, the local shards a check moves, and the hooks that keep ranks in lockstep.

FSDP2 (``fully_shard``) makes every parameter of a sharded module a ``DTensor`` placed ``Shard(0)`` over a 1-D device
mesh: each rank holds a block of rows, and the forward pass gathers the whole parameter from the shards. A check
moves the shards in place (the optimizer does the same) and never gathers a parameter outside the forward passes.
Other placements under FSDP2 on a 1-D mesh are refused with a message; tensor parallelism, alone or with FSDP2 on a
second mesh dimension, is :mod:`gradwatch.engine.distributed.tensor_parallel`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.engine.distributed.collective import Collective, Layout, global_loss, peers_ok
from gradwatch.errors import UnsupportedShardingError


def _is_dtensor(tensor: Tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "placements")


def is_sharded(params: Sequence[tuple[str, Tensor]]) -> bool:
    """Whether any of the parameters is a ``DTensor``."""
    return any(_is_dtensor(p) for _, p in params)


def local_shards(params: Sequence[tuple[str, Tensor]]) -> tuple[Collective, list[tuple[str, Tensor]]]:
    """The collective of the ranks the parameters are sharded over, and each parameter's local shard (the same
    storage: moving it moves the parameter the next forward pass gathers).

    Raises:
        UnsupportedShardingError: A parameter is not a ``DTensor`` while others are, is placed other than
            ``Shard(0)``, or lives on a mesh of more than one dimension or another mesh than the rest.
    """
    plain = [name for name, p in params if not _is_dtensor(p)]
    if plain:
        raise UnsupportedShardingError(
            f"gradwatch checks a sharded model whose checked parameters are all DTensors; {plain[:3]} are plain "
            "tensors (apply fully_shard to the root module too, or pass their names to ignore=)"
        )
    first = params[0][1].device_mesh  # type: ignore[attr-defined]
    for name, p in params:
        mesh, placements = p.device_mesh, tuple(p.placements)  # type: ignore[attr-defined]
        if mesh.ndim != 1 or mesh != first or [repr(x) for x in placements] != ["Shard(dim=0)"]:
            raise UnsupportedShardingError(
                f"gradwatch checks parameters sharded by rows over one 1-D mesh (FSDP2's fully_shard); {name!r} is "
                f"placed {placements} on a {mesh.ndim}-D mesh {tuple(mesh.mesh_dim_names or ())}: tensor-parallel "
                "placements mixed with FSDP2 on one 1-D mesh are not supported (tensor parallelism alone is, and "
                "with FSDP2 on a second mesh dimension; skip the check)"
            )
    group = first.get_group()
    collective = Collective(group=group, world=dist.get_world_size(group), rank=dist.get_rank(group))
    shards = []
    for name, p in params:
        local = p.to_local().detach()  # type: ignore[attr-defined]
        collective.layouts[id(local)] = _layout(p, local, collective)
        collective.parameters[id(local)] = p
        shards.append((name, local))
    return collective, shards


def _layout(param: Tensor, local: Tensor, collective: Collective) -> Layout:
    """Where the shard sits: FSDP2 splits rows as ``torch.chunk`` does (the last ranks may hold fewer, or none)."""
    rows = param.shape[0] if param.dim() else 1
    chunk = -(-rows // collective.world)
    offset = min(collective.rank * chunk, rows)
    held = max(0, min(chunk, rows - offset))
    if param.dim() == 0 or local.shape[0] != held or local.shape[1:] != param.shape[1:]:
        raise UnsupportedShardingError(
            f"a shard of shape {tuple(local.shape)} of a parameter of shape {tuple(param.shape)} is not the rows "
            f"{offset}:{offset + held} gradwatch expects on rank {collective.rank} of {collective.world}"
        )
    return Layout(param.shape, offset, held)


def register_like(collective: Collective, tensor: Tensor, like: Tensor) -> Tensor:
    """Give ``tensor`` (a gradient or a mask over shard ``like``) the layout of ``like``; returns ``tensor``."""
    collective.layouts[id(tensor)] = collective.layouts[id(like)]
    return tensor


def sharded_backward(
    collective: Collective, model: nn.Module, loss: Tensor, shards: Sequence[Tensor], leaves: dict[str, Tensor]
) -> tuple[float, list[Tensor | None]]:
    """The global loss and its gradient in a sharded check, for the shards and then the input ``leaves``.

    ``backward``, not ``autograd.grad``: FSDP reduces the parameters' gradients onto their shards in its backward hooks
    (autograd cannot differentiate with respect to a shard directly). The inputs' gradients are divided by the number of
    ranks: the global loss is the mean of the ranks' losses, as FSDP's averaged gradient says."""
    value = global_loss(float(loss.detach()))  # every rank reaches the backward's collectives, or none does
    loss.backward()
    grads = shard_gradients(collective, model, shards)
    grads += [None if leaf.grad is None else leaf.grad / collective.world for leaf in leaves.values()]
    return value, grads


def shard_gradients(collective: Collective, model: nn.Module, shards: Sequence[Tensor]) -> list[Tensor | None]:
    """After ``backward``: the gradient FSDP reduced onto each shard's parameter, as the local shard of it (``None``
    where the parameter got none). Every ``.grad`` of the model is then cleared (the check's captured state holds the
    user's), so that the next backward of the check does not accumulate onto this one."""
    grads: list[Tensor | None] = []
    for shard in shards:
        grad = collective.parameters[id(shard)].grad
        local = None if grad is None else grad.to_local().detach()  # type: ignore[attr-defined]
        grads.append(None if local is None else register_like(collective, local, shard))
    for param in model.parameters():
        param.grad = None
    return grads


@contextlib.contextmanager
def lockstep(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """For the duration: before each FSDP unit gathers its parameters, the ranks confirm that no evaluation failed
    (:func:`~gradwatch.engine.distributed.collective.peers_ok`), and after its forward the unit is resharded, so that
    the next evaluation gathers the shards as the probes moved them; afterwards every unit is resharded, also where a
    failed evaluation left one gathered. Nothing if not ``enabled``."""
    modules = [m for m in model.modules() if hasattr(m, "reshard") and hasattr(m, "unshard")] if enabled else []
    handles = [m.register_forward_pre_hook(lambda *_: peers_ok(), prepend=True) for m in modules]
    # FSDP keeps the root's parameters gathered after its forward: the next forward would not see its shards move
    handles += [m.register_forward_hook(lambda module, *_: module.reshard()) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module in modules:
            module.reshard()  # type: ignore[operator]


def local_mask(collective: Collective, mask: Tensor, shard: Tensor) -> Tensor:
    """A mask over a sharded parameter (a DTensor or a whole-parameter tensor), as a mask over this rank's shard."""
    if hasattr(mask, "to_local"):
        local = mask.to_local()
    else:
        found = collective.layouts[id(shard)]
        local = mask[found.offset : found.offset + found.rows]
    return register_like(collective, local, shard)
