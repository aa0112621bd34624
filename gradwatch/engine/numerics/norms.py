"""Norms and dot products of tensors, accumulated in float64 where a probe's numbers depend on them, with one host
transfer per device (a device sync per tensor would dominate a probe on a GPU).

In a sharded check the tensors are each rank's shards: every norm, sum and element count here is of the whole tensors,
reduced across the ranks (:mod:`gradwatch.engine.distributed`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from gradwatch.engine.distributed.collective import active, summed

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


CHUNK_ELEMENTS = 2**20
"""The elements of a large tensor an elementwise step makes its temporaries for at a time (8 MiB in float64)."""


def dot(a: Tensor, b: Tensor, *, a_scale: float | None = None, b_scale: float | None = None) -> Tensor:
    """``(a * a_scale) · (b * b_scale)`` over all elements (each scale 1 when ``None``, and no product made) as a 0-dim
    float64 tensor: products in float32 at least, accumulated in float64. Over more than :data:`CHUNK_ELEMENTS`
    elements the products are made a chunk at a time into the float64 copy the sum reads (``(a * b).sum(dtype=float64)``
    copies a whole float32 product): the same sum, bit for bit, with 2x the tensor's float32 size alive, not 3x."""
    if a.dtype in _SIXTEEN_BIT:
        a = a.float()
    if b.dtype in _SIXTEEN_BIT:
        b = b.float()
    plain = type(a) is Tensor and type(b) is Tensor and a.dtype == b.dtype == torch.float32
    if not (plain and a.numel() > CHUNK_ELEMENTS and a.shape == b.shape and a.is_contiguous() and b.is_contiguous()):
        return (_scaled(a, a_scale) * _scaled(b, b_scale)).sum(dtype=torch.float64)
    products = float64_chunks([a, b], lambda out, x, y: out.copy_(_scaled(x, a_scale) * _scaled(y, b_scale)))
    return products.sum()


def float64_chunks(inputs: Sequence[Tensor], fill: Callable[..., object]) -> Tensor:
    """A float64 tensor shaped as ``inputs[0]`` (all contiguous, of one shape), made :data:`CHUNK_ELEMENTS` at a time
    by ``fill(chunk, *chunks_of_inputs)`` writing each chunk in place: an elementwise step's float64 result with its
    temporaries a chunk's, not the tensor's."""
    result = torch.empty(inputs[0].shape, dtype=torch.float64, device=inputs[0].device)
    flat, flats = result.view(-1), [t.reshape(-1) for t in inputs]
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        part = slice(start, start + CHUNK_ELEMENTS)
        fill(flat[part], *(f[part] for f in flats))
    return result


def _scaled(tensor: Tensor, scale: float | None) -> Tensor:
    return tensor if scale is None else tensor * scale


def total(terms: Sequence[Tensor]) -> float:
    """The sum of 0-dim tensors, possibly on several devices (a model split across GPUs), as one host value."""
    if not terms:
        return summed([0.0])[0]
    device = terms[0].device
    return summed([torch.stack([t.to(device) for t in terms]).sum().item()])[0]


def norm(tensors: Sequence[Tensor]) -> float:
    """The Euclidean norm over all elements of the tensors."""
    return math.hypot(*norms(tensors))


_RELIABLE_NORMS = (1e-15, 1e15)
"""Norms computed in float32 outside this range may have lost their squares to underflow or overflow."""


def norms(tensors: Sequence[Tensor], *, exact: bool = False) -> list[float]:
    """The Euclidean norm of each tensor, with one host transfer per device: accumulated in the tensors' own dtype
    (16-bit ones in float32), precise enough for steps and scales, except outside :data:`_RELIABLE_NORMS` (a tiny
    late-training gradient, an exactly zero one, an overflow), computed again in float64; with ``exact`` all in float64,
    as the analytic slope along a gradient needs."""
    if not tensors:
        return []
    if active() is not None:
        squares = summed([value**2 for value in _local_norms(tensors, exact=True)])
        return [math.sqrt(value) for value in squares]
    values = _local_norms(tensors, exact)
    low, high = _RELIABLE_NORMS
    for i, value in enumerate(values):
        if not exact and not low < value < high:
            values[i] = torch.linalg.vector_norm(tensors[i].detach(), dtype=torch.float64).item()
    return values


def _local_norms(tensors: Sequence[Tensor], exact: bool) -> list[float]:
    groups: dict[torch.device, list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault(tensor.device, []).append(i)
    values = [0.0] * len(tensors)
    for positions in groups.values():
        batch = [
            tensors[i].detach().float() if tensors[i].dtype in _SIXTEEN_BIT else tensors[i].detach() for i in positions
        ]
        for i, value in zip(positions, torch.stack(_foreach_norm(batch, exact)).tolist(), strict=True):
            values[i] = value
    return values


def _foreach_norm(tensors: list[Tensor], exact: bool) -> list[Tensor]:
    """``torch._foreach_norm`` (one fused kernel where the backend has one), else one norm per tensor; accumulated in
    float64 if ``exact``."""
    dtype = torch.float64 if exact else None
    try:
        return list(torch._foreach_norm(tensors, 2, dtype=dtype))
    except (AttributeError, NotImplementedError, RuntimeError, TypeError):  # torch < 2.2 has no dtype argument
        return [torch.linalg.vector_norm(t, dtype=dtype) for t in tensors]


def rms(*tensors: Tensor) -> float:
    """Root mean square over all elements of the tensors: each tensor's norm as :func:`norms` computes it, combined in
    float64. Precise enough for the scales steps are relative to."""
    count = summed([sum(t.numel() for t in tensors)])[0]
    return norm(tensors) / math.sqrt(count) if count else 0.0
