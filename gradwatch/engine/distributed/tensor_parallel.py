"""Tensor-parallel models (``torch.distributed.tensor.parallel``: parameters as ``DTensor``\\ s sharded across a mesh,
inputs and outputs redistributed by module hooks), checked as plain replicated modules.

Under tensor parallelism every rank of the group computes the same loss on the same batch; the parameters are split
(column- or row-wise) or replicated. A check :func:`made_plain` the model for its duration: each ``DTensor`` parameter
replaced, in its module, by a plain parameter holding the whole tensor (``full_tensor()``, a collective), and the
hooks of ``torch.distributed.tensor`` set aside, so that the forward computes the same function on whole tensors, on
every rank alike. Afterwards the very ``DTensor`` parameters are put back: whatever a check did to the plain copies
cannot reach them. The gradients of the check are the whole ones (:func:`whole_gradients`): a replicated parameter's
gradient is this rank's own, so ranks that disagree on it stay visible to the cross-rank comparison of an applied
check. FSDP2-sharded models (``fully_shard``) are left to :mod:`gradwatch.engine.distributed.parameters`; a model with
both is refused there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor, nn

from gradwatch.engine.distributed.library_hooks import hooks_set_aside

TENSOR_PARALLEL_NOTE = (
    "tensor parallel: the model's DTensor parameters made whole on every rank for the check (its redistributing "
    "hooks set aside), the loss every rank computes alike, the replicated parameters' gradients compared across ranks"
)


def _is_dtensor(tensor: Any) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "full_tensor")


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether ``model`` has ``DTensor`` parameters and no FSDP2 module (``fully_shard`` adds ``reshard``)."""
    if not any(_is_dtensor(p) for p in model.parameters()):
        return False
    return not any(hasattr(m, "reshard") and hasattr(m, "unshard") for m in model.modules())


def mesh_group(model: nn.Module) -> Any:
    """The process group of the mesh the model's ``DTensor`` parameters live on (a 1-D mesh)."""
    param = next(p for p in model.parameters() if _is_dtensor(p))
    mesh = param.device_mesh  # type: ignore[attr-defined]
    if mesh.ndim != 1:
        raise ValueError(
            f"gradwatch checks tensor-parallel models on a 1-D mesh; the parameters live on a {mesh.ndim}-D mesh "
            f"{tuple(mesh.mesh_dim_names or ())}"
        )
    return mesh.get_group()


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
    tensor, and ``torch.distributed.tensor``'s module hooks set aside; the ``DTensor`` parameters are put back after.
    A collective: every rank enters together."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and _is_dtensor(param):
                swapped.append((module, name, param))
    plain = [nn.Parameter(whole(param).clone(), requires_grad=param.requires_grad) for _, _, param in swapped]
    try:
        for (module, name, _), copy in zip(swapped, plain, strict=True):
            module._parameters[name] = copy
        with hooks_set_aside(model, "torch.distributed.tensor"):
            yield
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param
