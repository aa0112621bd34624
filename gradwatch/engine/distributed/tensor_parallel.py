"""Tensor-parallel models (``torch.distributed.tensor.parallel``: parameters as ``DTensor``\\ s sharded across a mesh,
inputs and outputs redistributed by module hooks), checked as plain replicated modules.

Every rank of the group computes the same loss on the same batch. A check :func:`made_plain` the model for its
duration: each ``DTensor`` parameter replaced, in its module, by a plain parameter holding the whole tensor
(``full_tensor()``, a collective), and the hooks of ``torch.distributed.tensor`` set aside, so that the forward
computes the same function on whole tensors on every rank. Afterwards the very ``DTensor`` parameters are put back,
out of reach of whatever the check did to the copies. The check's gradients are the whole ones
(:func:`whole_gradients`): a replicated parameter's is this rank's own, so ranks that disagree on it stay visible to
an applied check's cross-rank comparison.

With FSDP2 on a second mesh dimension (``("dp", "tp")``, as torchtitan composes them), and FSDP2's hybrid sharding on
a 2-D mesh, the same holds with FSDP2's hooks set aside too: each parameter is gathered over both dimensions, every
rank computes the loss of its own data-parallel batch, and the applied check averages the window loss over every rank
of the mesh (the data-parallel mean FSDP's gradient differentiates) and compares the whole gradients across all of
them. FSDP2 alone on a 1-D mesh is left to :mod:`gradwatch.engine.distributed.parameters`, which probes the shards in
place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.engine.distributed import hooks_set_aside

TENSOR_PARALLEL_NOTE = (
    "tensor parallel: the model's DTensor parameters made whole on every rank for the check (its redistributing "
    "hooks set aside), the loss every rank computes alike, the replicated parameters' gradients compared across ranks"
)

_PACKAGES = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed._composable")
"""Where the module hooks a check sets aside are defined: tensor parallelism's redistributions, FSDP2's gathering."""


_REPLICAS: ContextVar[Any] = ContextVar("gradwatch_tensor_parallel_group", default=None)


def replicas_group() -> Any:
    """Inside :func:`made_plain`: the process group of every rank of the model's mesh (ranks that compute the same loss
    on the same batch must compute the same gradient:
    :func:`~gradwatch.engine.recomputed.layout.disagreeing_replicas`); else ``None``."""
    return _REPLICAS.get()


def any_replica(flag: bool) -> bool:
    """Inside :func:`made_plain`, whether ``flag`` is true on any rank of the model's mesh (one all-reduce); ``flag``
    itself elsewhere. A check whose loss runs the model's collectives must take every decision alike on every rank,
    including those that rest on a rank's own timings or free memory, or the ranks' collectives stop matching."""
    group = _REPLICAS.get()
    if group is None:
        return flag
    value = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item() > 0)


def _is_dtensor(tensor: Any) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "full_tensor")


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether ``model`` has ``DTensor`` parameters and either no FSDP2 module (``fully_shard`` adds ``reshard``) or
    parameters on a mesh of more than one dimension (FSDP2 over a tensor-parallel plan, or hybrid sharding)."""
    dtensors = [p for p in model.parameters() if _is_dtensor(p)]
    if not dtensors:
        return False
    if any(p.device_mesh.ndim > 1 for p in dtensors):  # type: ignore[attr-defined]
        return True
    return not any(hasattr(m, "reshard") and hasattr(m, "unshard") for m in model.modules())


def mesh_group(model: nn.Module) -> Any:
    """The process group of every rank the model's ``DTensor`` parameters live on: the group of a 1-D mesh, the
    default group for a larger mesh that spans every process.

    Raises:
        ValueError: The parameters live on a mesh of several dimensions that leaves processes out (pass ``group=``).
    """
    meshes = [p.device_mesh for p in model.parameters() if _is_dtensor(p)]  # type: ignore[attr-defined]
    mesh = max(meshes, key=lambda m: (m.size(), m.ndim))
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"the model's parameters live on a {mesh.ndim}-D mesh {tuple(mesh.mesh_dim_names or ())} of "
            f"{mesh.size()} of the {dist.get_world_size()} processes: pass `group=` the process group of its ranks"
        )
    return dist.group.WORLD


def whole(tensor: Tensor) -> Tensor:
    """``tensor`` whole (``full_tensor()`` of a ``DTensor``, a collective), ``tensor`` itself otherwise."""
    return tensor.full_tensor().detach() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def whole_gradients(model: nn.Module, gradients: Mapping[str, Tensor] | None) -> dict[str, Tensor]:
    """The gradients to check, whole: ``gradients`` (by name), or each trainable parameter's ``.grad``. A collective:
    every rank calls it together (the parameters are visited in the same order on every rank)."""
    if gradients is not None:
        return {name: whole(g) for name, g in gradients.items()}
    return {n: whole(p.grad) for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


@contextlib.contextmanager
def made_plain(model: nn.Module) -> Iterator[None]:
    """For the duration, every ``DTensor`` parameter of ``model`` replaced by a plain parameter holding the whole
    tensor, and the module hooks of ``torch.distributed.tensor`` and FSDP2 set aside; the ``DTensor`` parameters are
    put back after. A collective: every rank enters together."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and _is_dtensor(param):
                swapped.append((module, name, param))
    plain = [nn.Parameter(whole(param).clone(), requires_grad=param.requires_grad) for _, _, param in swapped]
    group = None
    if swapped and dist.is_initialized():
        with contextlib.suppress(ValueError):  # a mesh that leaves processes out: none
            group = mesh_group(model)
    token = _REPLICAS.set(group)
    try:
        for (module, name, _), copy in zip(swapped, plain, strict=True):
            module._parameters[name] = copy
        with contextlib.ExitStack() as stack:
            for package in _PACKAGES:
                stack.enter_context(hooks_set_aside(model, package))
            yield
    finally:
        _REPLICAS.reset(token)
        for module, name, param in swapped:
            module._parameters[name] = param
