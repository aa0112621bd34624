"""Probes that test every tensor of an applied gradient at once, and when to look at the tensors one by one.

A fault in one tensor ``T`` (its gradient ``(1 + r)`` times the derivative, say) moves the derivative along a unit
direction ``d`` by ``r / (1 + r) · g_T · d_T``. Along ``ĝ`` (the descent probe) that is ``r · ‖g_T‖² / ‖g‖``: a tensor
with a small share of ``‖g‖`` is invisible there. Along the **balanced** direction ``Σ_T ĝ_T / √N`` (each tensor's own
normalised gradient, with equal weight) it is ``r · ‖g_T‖ / √N``, judged against the path's floor along that
direction, ``Σ_T floor_T / √N`` (Cauchy-Schwarz, tensor by tensor): every tensor is seen in proportion to its own
gradient against the floors of all, in one probe instead of ``N``.

The price is resolution: the floors of all tensors add up along a combined direction, so the smallest fault of ``T``
it resolves, ``tolerance / (w_T ‖g_T‖²)`` for a direction whose part in ``T`` is ``w_T g_T``, is larger than the
``multiple · floor_T / ‖g_T‖`` of ``T``'s own probe. A combined probe that agrees **vouches** for the tensors it
resolves about as well (:func:`unvouched`): every tensor of a float32 path (floors ~1e-7 of ``‖g‖``), few of a 16-bit
one (floors ~1e-2), whose other tensors keep their own probes. The tensor probes are also made, in turn, when a
combined probe does not agree well within its tolerance (:data:`CLOSER_LOOK`), and every tensor when one fails, so
that a failing report still names the tensors at fault.

A few tensors with a large floor spoil the vouching for all the others: on a float32 path a convolution before
BatchNorm (its gradient a difference of nearly equal terms) is off by ~1e-3 of its gradient, a thousand times the rest,
and its floor then dominates the tolerance of every combined direction through it. The tensors left unvouched are
grouped (:func:`vouching_groups`) into balanced probes over those tensors alone, each group one a balanced probe over
it would vouch for at its floors: one probe for the many precise tensors instead of one each, and the tensors with a
large floor left to their own probes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

CLOSER_LOOK = 0.5
"""A combined probe whose discrepancy exceeds this fraction of its tolerance (its ``excess``), though it agrees, sends
the check on to the tensor probes (in turn, ``tensor_probes`` of them): healthy checks stay below 0.5 on the benchmark
models (``docs/benchmarks.md``), while a fault just under the tolerance is then looked at tensor by tensor."""


RESOLUTION_LOSS = 2.0
"""A combined probe vouches for a tensor when it resolves a fault of that tensor at most this many times larger than
the tensor's own probe would (or :data:`RESOLUTION_TARGET`, whichever is larger)."""

RESOLUTION_TARGET = 1e-3
"""... or when it resolves a relative fault of that tensor of this size: the smallest relative error the recomputed
check is calibrated to catch in float32 (``docs/benchmarks.md``)."""


def balanced_weights(grad_norms: Sequence[float]) -> list[float]:
    """The coefficient of each tensor's applied gradient in the balanced unit direction, ``1 / (‖g_T‖ √N)`` over the
    ``N`` tensors with a finite, nonzero gradient (0 for the others)."""
    usable = [n > 0 and math.isfinite(n) for n in grad_norms]
    count = sum(usable)
    if not count:
        return [0.0] * len(grad_norms)
    root = math.sqrt(count)
    return [1.0 / (n * root) if ok else 0.0 for n, ok in zip(grad_norms, usable, strict=True)]


def balanced_components(grads: Sequence[Tensor], weights: Sequence[float]) -> list[Tensor]:
    """The balanced unit direction, tensor by tensor (``weights[i] · grads[i]``; new tensors, the gradients are left
    as they are)."""
    return [grad * weight for grad, weight in zip(grads, weights, strict=True)]


def floor_along(floors: Sequence[float], part_norms: Sequence[float]) -> float:
    """The path's noise floor along a unit direction whose part in tensor ``T`` has norm ``part_norms[T]``: no gradient
    within ``floor_T`` of a correct one in every tensor is further off along it than ``Σ_T floor_T · ‖d_T‖``."""
    return math.fsum(f * n for f, n in zip(floors, part_norms, strict=True))


@dataclass(frozen=True)
class Combined:
    """What :func:`tensors_to_probe` needs of one combined probe: its verdict, its discrepancy over its tolerance
    (``excess``), its tolerance, and the coefficient ``w_T`` of each tensor's applied gradient in its direction."""

    verdict: str
    excess: float
    tolerance: float
    weights: Mapping[int, float]


def unvouched(
    combined: Sequence[Combined], grad_norms: Sequence[float], floors: Sequence[float], multiple: float
) -> list[int]:
    """The tensors (with a gradient) that no agreeing combined probe resolves nearly as well as their own probe would
    (:data:`RESOLUTION_LOSS`, :data:`RESOLUTION_TARGET`), leaving out those whose own probe resolves nothing smaller
    than their gradient itself (its floor ``multiple`` times at least as large)."""
    left = []
    for i, (size, floor) in enumerate(zip(grad_norms, floors, strict=True)):
        if not size > 0 or not math.isfinite(size):
            continue
        own = multiple * floor / size
        if own >= 1:  # its own probe resolves no fault smaller than its gradient (a bias before a norm): none to make
            continue
        resolved = [
            probe.tolerance / (probe.weights[i] * size * size)
            for probe in combined
            if probe.verdict == "ok" and probe.weights.get(i, 0.0) > 0
        ]
        if min(resolved, default=math.inf) > max(RESOLUTION_LOSS * own, RESOLUTION_TARGET):
            left.append(i)
    return left


def vouching_groups(
    candidates: Sequence[int], grad_norms: Sequence[float], floors: Sequence[float], multiple: float
) -> list[list[int]]:
    """Groups of two or more ``candidates`` such that a balanced probe over a group alone, at the floors (before its
    own noise), would vouch for each of its tensors (:func:`unvouched`'s test). Along the balanced direction over ``k``
    tensors, ``T`` resolves ``multiple · Σ floor / ‖g_T‖``, so the test is ``Σ floor ≤ cap_T`` with ``cap_T`` the
    larger of ``RESOLUTION_LOSS · floor_T`` and ``RESOLUTION_TARGET · ‖g_T‖ / multiple``: the tensors are taken in
    order of their floor and added while the sum stays within every member's cap, then the rest grouped again."""
    usable = [i for i in candidates if grad_norms[i] > 0 and math.isfinite(grad_norms[i]) and math.isfinite(floors[i])]
    caps = {i: max(RESOLUTION_LOSS * floors[i], RESOLUTION_TARGET * grad_norms[i] / multiple) for i in usable}
    left = sorted(usable, key=lambda i: floors[i])
    groups = []
    while len(left) >= 2:
        group, rest, spent, cap = [], [], 0.0, math.inf
        for i in left:
            if spent + floors[i] <= min(cap, caps[i]):
                group.append(i)
                spent, cap = spent + floors[i], min(cap, caps[i])
            else:
                rest.append(i)
        if len(group) < 2:  # the smallest floor fits with none of the others: it keeps its own probe
            left = left[1:]
            continue
        groups.append(group)
        left = rest
    return groups


def tensors_to_probe(
    combined: Sequence[Combined],
    grad_norms: Sequence[float],
    floors: Sequence[float],
    multiple: float,
    *,
    tensor_probes: int | None,
    rotation: int,
    also: Sequence[int] = (),
) -> list[int]:
    """Which tensors to probe one by one after the combined probes: every one when one fails; ``tensor_probes`` of
    them in turn (all for ``None``) from the ``rotation``-th window on (the check's position in a series) when one does
    not agree within :data:`CLOSER_LOOK` of its tolerance; else those none of them vouches for (:func:`unvouched`),
    again ``tensor_probes`` of them in turn; and every one of ``also`` besides."""
    count = len(grad_norms)
    if any(probe.verdict == "fail" for probe in combined):
        return list(range(count))
    calm = combined and all(p.verdict == "ok" and math.isfinite(p.excess) and p.excess <= CLOSER_LOOK for p in combined)
    candidates = unvouched(combined, grad_norms, floors, multiple) if calm else list(range(count))
    if not (tensor_probes is None or tensor_probes >= len(candidates)):
        first = (rotation * tensor_probes) % len(candidates)
        candidates = [candidates[(first + k) % len(candidates)] for k in range(tensor_probes)]
    return candidates + sorted(set(also) - set(candidates))
