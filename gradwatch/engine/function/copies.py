"""The parameters of a model as a check found them: copied once, compared cheaply, put back exactly.

:class:`FlatCopies` copies the parameters into one flat buffer per dtype and device, so that copying them takes a few
operations however many tensors the model has; they are compared tensor by tensor (no flat temporary of the model)
with :func:`same_bits`, bit for bit (NaNs and signed zeros included), which is what "put back exactly" means.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

PARAMETER_COPY_LIMIT = 2**26
"""The most parameter elements of which a check keeps a copy (256 MiB of float32). Beyond it an in-place change by the
loss is seen by the version counter after the first evaluation; the values before it cannot be put back, and the
report names them in :attr:`~gradwatch.engine.results.report.CheckReport.unrestored`."""


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors hold the same bits (NaNs and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_floating_point() or a.is_complex():
        integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
        if integer is not None and not a.is_complex():
            return torch.equal(a.view(integer), b.view(integer))
        return torch.equal(
            torch.view_as_real(a) if a.is_complex() else a, torch.view_as_real(b) if b.is_complex() else b
        )
    return torch.equal(a, b)


def local_tensor(tensor: Tensor) -> Tensor:
    """The tensor this process holds: a sharded parameter's local shard (no collective), else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor.detach()


@dataclass(eq=False)
class SavedParameter:
    """A parameter as the check found it."""

    tensor: Tensor
    label: str
    alias: Tensor  # shares the storage the parameter had (``.data`` rebound is put back to it)
    copy: Tensor | None
    version: int
    slots: list[tuple[nn.Module, str]]

    def storage_moved(self) -> bool:
        t, a = self.tensor, self.alias
        if hasattr(t, "to_local"):  # a sharded parameter: its shards are the sharding's business
            return False
        return t.data_ptr() != a.data_ptr() or t.shape != a.shape or t.stride() != a.stride() or t.dtype != a.dtype


_KEPT: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""A weak reference to the guard's copy of each copied parameter, while the guard (its :class:`FlatCopies`) lives."""


def kept_copy(tensor: Tensor) -> Tensor | None:
    """The copy a check's guard holds of ``tensor`` (a parameter) where its bits are the tensor's now: a probe restores
    the tensor from it instead of cloning it (a guard's copy is never written, only read); ``None`` otherwise."""
    ref = _KEPT.get(tensor)
    copy = ref() if ref is not None else None
    return copy if copy is not None and same_bits(tensor.detach(), copy) else None


class FlatCopies:
    """Copies of the parameters (up to :data:`PARAMETER_COPY_LIMIT` elements), one flat buffer per dtype and device;
    sets each copied parameter's ``copy`` (:func:`kept_copy` finds it)."""

    def __init__(self, parameters: list[SavedParameter]) -> None:
        groups: dict[tuple[torch.dtype, torch.device], list[SavedParameter]] = {}
        copied = 0
        for parameter in parameters:
            local = local_tensor(parameter.tensor)
            if copied + local.numel() <= PARAMETER_COPY_LIMIT:
                copied += local.numel()
                groups.setdefault((local.dtype, local.device), []).append(parameter)
        self._groups: list[tuple[list[SavedParameter], Tensor]] = []
        for members in groups.values():
            locals_ = [local_tensor(parameter.tensor) for parameter in members]
            flat = torch.cat([local.reshape(-1) for local in locals_])
            offset = 0
            for parameter, local in zip(members, locals_, strict=True):
                parameter.copy = flat[offset : offset + local.numel()].view(local.shape)
                offset += local.numel()
                if not hasattr(parameter.tensor, "to_local"):  # a shard is the sharding's business
                    _KEPT[parameter.tensor] = weakref.ref(parameter.copy)
            self._groups.append((members, flat))

    def differing(self) -> set[int]:
        """``id`` of each copied parameter whose bits differ from its copy now."""
        # tensor by tensor against its view of the flat copy: no flat temporary of the model (1x its parameters)
        return {
            id(p)
            for members, _ in self._groups
            for p in members
            if p.copy is not None and not same_bits(local_tensor(p.tensor), p.copy)
        }
