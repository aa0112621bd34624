"""The finished probes of an applied check: which tensors they vouch for, and when they call for a closer look.

**Combined probes.** A fault in one tensor ``T`` (its gradient ``(1 + r)`` times the derivative, say) moves the
derivative along a unit direction ``d`` by ``r / (1 + r) · g_T · d_T``. Along ``ĝ`` (the descent probe) that is
``r · ‖g_T‖² / ‖g‖``: a tensor with a small share of ``‖g‖`` is invisible there. Along the **balanced** direction
``Σ_T ĝ_T / √N`` it is ``r · ‖g_T‖ / √N``, judged against the path's floor along it, ``Σ_T floor_T / √N``
(Cauchy-Schwarz, tensor by tensor): every tensor is seen in proportion to its own gradient, in one probe instead of
``N``. The price is resolution: the floors of all tensors add up along a combined direction, so the smallest fault of
``T`` it resolves, ``tolerance / (w_T ‖g_T‖²)`` for a direction whose part in ``T`` is ``w_T g_T``, is larger than the
``multiple · floor_T / ‖g_T‖`` of ``T``'s own probe. A combined probe that agrees **vouches** for the tensors it
resolves about as well (:func:`unvouched`): every tensor of a float32 path (floors ~1e-7 of ``‖g‖``), few of a 16-bit
one (~1e-2), whose other tensors keep their own probes. A few tensors with a large floor spoil the vouching for all:
on a float32 path a convolution before BatchNorm is off by ~1e-3 of its gradient, a thousand times the rest. The
tensors left unvouched are grouped (:func:`vouching_groups`) into balanced probes over a group alone that vouch for it
at its floors: one probe for the many precise tensors, the large floors left to their own probes.

**The measured rounding.** A probe's discrepancy ``a − D`` holds the rounding of the path's gradient along its
direction, which its tolerance allows for tensor by tensor, so a rounding of the same sign in every tensor (a float32
CNN at initialisation) brings a healthy combined probe close to :data:`CLOSER_LOOK` of its tolerance. Once the float64
floor is measured (:mod:`.measurement`) that rounding is known as a vector: the eager gradient less the float64 one,
``e``, whose part along the probe, ``e · d`` (:attr:`Measured.explained`), is the discrepancy rounding alone would
give. What calls for a closer look is what is left beyond it, or the discrepancy itself where that is smaller
(:attr:`Measured.closer`): a fault of the applied gradient, which ``e`` does not hold (the float64 gradient applies the
same formulas and hooks), is left there whole. The verdict is left as it was: a probe fails only beyond its tolerance.
With the rounding measured the probes also vouch at the tolerance of the storage rounding alone while what the rounding
leaves is calm there (:func:`vouchers`), and a tensor whose own probe the known parts alone would take beyond half its
tolerance is probed (:meth:`Rounding.beyond`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass

import torch
from torch import Tensor

from gradwatch.engine.numerics.norms import CHUNK_ELEMENTS, dot, float64_chunks, total
from gradwatch.engine.results.report import Probe

CLOSER_LOOK = 0.5
"""A combined probe whose discrepancy exceeds this fraction of its tolerance (its ``excess``), though it agrees, sends
the check on to the tensor probes: healthy checks stay below it on the benchmark models (``docs/benchmarks.md``)."""


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


def floor_along(floors: Sequence[float], part_norms: Sequence[float]) -> float:
    """The path's noise floor along a unit direction whose part in tensor ``T`` has norm ``part_norms[T]``,
    ``Σ_T floor_T · ‖d_T‖`` (Cauchy-Schwarz)."""
    return math.fsum(f * n for f, n in zip(floors, part_norms, strict=True))


@dataclass(frozen=True)
class Combined:
    """What :func:`tensors_to_probe` needs of one combined probe (``weights``: the coefficient ``w_T`` of each
    tensor's applied gradient in its direction)."""

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
    """Groups of two or more ``candidates`` that a balanced probe over a group alone, at the floors, would vouch for
    (:func:`unvouched`'s test): ``T`` resolves ``multiple · Σ floor / ‖g_T‖`` there, so the test is ``Σ floor ≤
    cap_T``, ``cap_T`` the larger of ``RESOLUTION_LOSS · floor_T`` and ``RESOLUTION_TARGET · ‖g_T‖ / multiple``. The
    tensors are taken in order of their floor while the sum stays within every member's cap, then the rest again."""
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


def tensors_to_probe(combined: Sequence[Combined], grad_norms: Sequence[float], floors: Sequence[float],
                     multiple: float, *, tensor_probes: int | None, rotation: int,
                     also: Sequence[int] = ()) -> list[int]:  # fmt: skip
    """Which tensors to probe one by one after the combined probes: every one when one fails; when one does not agree
    within :data:`CLOSER_LOOK`, all, else those none vouches for (:func:`unvouched`), ``tensor_probes`` of them in turn
    (the ``rotation``-th turn; all for ``None``); and every one of ``also`` besides."""
    count = len(grad_norms)
    if any(probe.verdict == "fail" for probe in combined):
        return list(range(count))
    calm = combined and all(p.verdict == "ok" and math.isfinite(p.excess) and p.excess <= CLOSER_LOOK for p in combined)
    candidates = unvouched(combined, grad_norms, floors, multiple) if calm else list(range(count))
    if not (tensor_probes is None or tensor_probes >= len(candidates)):
        first = (rotation * tensor_probes) % len(candidates)
        candidates = [candidates[(first + k) % len(candidates)] for k in range(tensor_probes)]
    return candidates + sorted(set(also) - set(candidates))


@dataclass
class Measured:
    """A finished probe and what an attribution needs of it: the tensors it moved, its direction's coefficient over the
    applied gradient in each, its tolerance; ``explained``, the discrepancy ``a − D`` the measured rounding predicts
    along it (0 when not measured); ``exact_tolerance``, the tolerance with the floor at the storage rounding alone
    (:func:`vouchers`; ``nan`` when the rounding is not measured)."""

    probe: Probe
    tensors: tuple[int, ...]
    weights: tuple[float, ...]
    tolerance: float
    excess: float
    explained: float = 0.0
    _: KW_ONLY
    exact_tolerance: float = math.nan

    @property
    def closer(self) -> float:
        """The discrepancy left beyond ``explained``, over the tolerance, or ``excess`` where that is smaller: what
        :func:`calm` holds against :data:`CLOSER_LOOK`."""
        if not self.explained or not math.isfinite(self.excess):
            return self.excess
        left = abs(self.probe.analytic - self.probe.numeric - self.explained)
        return min(self.excess, left / self.tolerance if self.tolerance > 0 else math.inf)

    def combined(self) -> Combined:
        """What :func:`tensors_to_probe` needs of it."""
        weights = dict(zip(self.tensors, self.weights, strict=True))
        return Combined(self.probe.verdict, self.closer, self.tolerance, weights)

    def exact(self) -> Combined | None:
        """:meth:`combined` judged at ``exact_tolerance``, its discrepancy less ``explained``; ``None`` when the
        rounding is not measured."""
        if not self.exact_tolerance > 0 or not math.isfinite(self.exact_tolerance):
            return None
        left = abs(self.probe.analytic - self.probe.numeric - self.explained)
        weights = dict(zip(self.tensors, self.weights, strict=True))
        return Combined(self.probe.verdict, left / self.exact_tolerance, self.exact_tolerance, weights)

    def agrees(self, grads: Sequence[Tensor], applied: Sequence[Tensor]) -> bool:
        """Whether another gradient ``grads`` agrees with the measured derivative along this probe's direction."""
        pairs = zip(self.tensors, self.weights, strict=True)
        slope = total([w * dot(grads[i], applied[i]) for i, w in pairs])
        return math.isfinite(slope) and abs(slope - self.probe.numeric) <= self.tolerance


def explained(rounding: Sequence[float] | None, tensors: Sequence[int], weights: Sequence[float]) -> float:
    """The discrepancy ``a − D`` the measured rounding ``rounding[T] = e_T · g_T`` predicts along ``Σ_T w_T g_T``:
    ``Σ_T w_T (e_T · g_T)`` (0 without a measured rounding)."""
    if rounding is None:
        return 0.0
    value = math.fsum(w * rounding[i] for i, w in zip(tensors, weights, strict=True))
    return value if math.isfinite(value) else 0.0


def vouchers(measured: Sequence[Measured]) -> list[Combined]:
    """The probes as they vouch for the tensors (:func:`unvouched`, :func:`tensors_to_probe`): at ``exact_tolerance``
    once every probe's discrepancy less what the rounding explains is within :data:`CLOSER_LOOK` of it (a fault its own
    probe would resolve moves that by at least half of it, sending the check back to the probes' own tolerance), so a
    float32 CNN at initialisation needs no group or tensor probe for its precise tensors; else at their own."""
    exact = [m.exact() for m in measured]
    chosen = [c for c in exact if c is not None and c.verdict == "ok" and c.excess <= CLOSER_LOOK]
    if measured and len(chosen) == len(measured):
        return chosen
    return [m.combined() for m in measured]


@dataclass(frozen=True)
class Rounding:
    """What the float64 gradient tells of the applied one without a probe, per tensor along ``g_T``: ``eager[T] =
    (eager_T − float64_T) · g_T`` (the path's rounding) and ``path[T] = (g_T − eager_T) · g_T`` (another rounding of
    the same path, or a fault of the training's path)."""

    eager: Sequence[float]
    path: Sequence[float]

    def beyond(self, grad_norms: Sequence[float], floors: Sequence[float], multiple: float) -> list[int]:
        """The tensors whose own probe the known parts alone, ``|eager[T] + path[T]| / ‖g_T‖``, would take beyond
        :data:`CLOSER_LOOK` of its tolerance at the floor: probed one by one, their ``path`` part left in the combined
        probes' closer look; not those whose own probe resolves nothing smaller than their gradient."""
        known = zip(self.eager, self.path, grad_norms, floors, strict=True)
        limit = CLOSER_LOOK * multiple
        return [
            i
            for i, (eager, path, size, floor) in enumerate(known)
            if size > 0
            and math.isfinite(size)
            and multiple * floor < size
            and not abs(eager + path) / size <= limit * floor
        ]

    def explained(self, beyond: Sequence[int]) -> list[float]:
        """Per tensor, what the combined probes' closer look discounts (:attr:`Measured.explained`): the rounding, and
        the ``path`` part of the tensors not ``beyond`` (no tensor probe could fail by it)."""
        left = set(beyond)
        return [e + (0.0 if i in left else p) for i, (e, p) in enumerate(zip(self.eager, self.path, strict=True))]


def difference_dot(x: Tensor, y: Tensor, a: Tensor) -> float:
    """``(x − y) · a`` in float64, as ``dot(x.double() - y.double(), a)`` computes it bit for bit, with one float64
    copy alive where the three are contiguous (the difference made and multiplied in place, a chunk of
    :data:`~gradwatch.engine.numerics.norms.CHUNK_ELEMENTS` at a time: elementwise, the same bits) instead of three."""
    if not (x.is_contiguous() and y.is_contiguous() and a.is_contiguous()):  # the product's layout, the sum's order
        return float(dot(x.double() - y.double(), a))
    if not x.shape == y.shape == a.shape or x.numel() <= CHUNK_ELEMENTS:
        difference = x.to(torch.float64, copy=True)
        return float(difference.sub_(y.double()).mul_(a).sum(dtype=torch.float64))
    difference = float64_chunks([x, y, a], lambda out, p, q, r: out.copy_(p).sub_(q.double()).mul_(r))
    return float(difference.sum(dtype=torch.float64))


def off_eager(applied: Sequence[Tensor], eager: Sequence[Tensor], grad_norms: Sequence[float], floors: Sequence[float],
              multiple: float) -> list[int]:  # fmt: skip
    """On a 16-bit path, the tensors whose applied gradient is further from eager float32's along ``ĝ_T``,
    ``|(g_T − eager_T) · ĝ_T|``, than :data:`CLOSER_LOOK` of its own probe's tolerance at the floor: a fault in one
    tensor's 16-bit backward shows there whole, where the combined probes sum every tensor's floor. Each is probed on
    its own (a correct path's rounding stays within its floor, so a healthy check rarely probes one more); not those
    whose own probe resolves nothing smaller than their gradient."""
    limit = CLOSER_LOOK * multiple
    found = []
    for i, (g, e, size, floor) in enumerate(zip(applied, eager, grad_norms, floors, strict=True)):
        if not (size > 0 and math.isfinite(size)) or multiple * floor >= size:
            continue
        along = abs(difference_dot(g, e, g)) / size
        if not along <= limit * floor:
            found.append(i)
    return found


def calm(measured: Sequence[Measured]) -> bool:
    """Whether every probe agrees, its discrepancy beyond the measured rounding within :data:`CLOSER_LOOK`
    of its tolerance."""
    return all(m.probe.verdict == "ok" and m.closer <= CLOSER_LOOK for m in measured)
