"""A finished probe of an applied check, and when the probes call for a closer look.

A probe's discrepancy ``a − D`` (the applied gradient's slope against the measured derivative) holds the rounding of
the path's gradient along its direction. Its tolerance allows for that rounding by Cauchy-Schwarz, tensor by tensor
(``Σ_T floor_T ‖d_T‖``), so a rounding of the same sign in every tensor (common-mode: a float32 CNN at initialisation)
brings a healthy combined probe close to half its tolerance, which alone would send the check on to tensor probes
(:data:`~.combined.CLOSER_LOOK`). Once the float64 floor is measured (:mod:`.measurement`) that rounding is known as a
vector, not only as a norm: the eager gradient less the float64 one, ``e``. Its part along the probe's direction,
``e · d`` (:attr:`Measured.explained`), is then the discrepancy rounding alone would give, and what calls for a closer
look is what is left of the discrepancy beyond it, or the discrepancy itself where that is smaller (the finite
difference's own error can cancel part of the rounding: :attr:`Measured.closer`): a fault of the applied gradient,
which ``e`` does not hold (the float64 gradient applies the same formulas and hooks; a fault of the training's path
alone is in neither), is left there whole. A check calm by the discrepancy itself is calm as before; one that the
rounding explains is calm now. The verdict is left as it was: a probe fails only beyond its tolerance.

With the rounding measured, the probes also vouch for the tensors at the tolerance of the storage rounding alone while
what the rounding leaves is calm there (:func:`vouchers`), and a tensor whose own probe the known parts alone would take
beyond half its tolerance is probed (:meth:`Rounding.beyond`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass

from torch import Tensor

from gradwatch.engine.applied.combined import CLOSER_LOOK, Combined
from gradwatch.engine.numerics.norms import dot, total
from gradwatch.engine.results.report import Probe


@dataclass
class Measured:
    """A finished probe and what an attribution needs of it: which tensors it moved, its unit direction's coefficient
    over the applied gradient in each of them, the derivative it measured and its tolerance; ``explained``, the
    discrepancy ``a − D`` the path's measured rounding predicts along its direction (0 when that is not measured);
    ``exact_tolerance``, with that rounding measured, the tolerance with the floor at the storage rounding alone
    (:func:`vouchers`; ``nan`` when it is not measured)."""

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
        """The discrepancy left beyond the rounding that ``explained`` predicts, over the tolerance, or ``excess`` where
        that is smaller (and when nothing is explained): what :func:`calm` holds against
        :data:`~.combined.CLOSER_LOOK`."""
        if not self.explained or not math.isfinite(self.excess):
            return self.excess
        left = abs(self.probe.analytic - self.probe.numeric - self.explained)
        return min(self.excess, left / self.tolerance if self.tolerance > 0 else math.inf)

    def combined(self) -> Combined:
        """What :func:`~.combined.tensors_to_probe` needs of it."""
        weights = dict(zip(self.tensors, self.weights, strict=True))
        return Combined(self.probe.verdict, self.closer, self.tolerance, weights)

    def exact(self) -> Combined | None:
        """What :func:`~.combined.tensors_to_probe` needs of it judged at ``exact_tolerance``, its discrepancy less
        ``explained``; ``None`` when the rounding is not measured."""
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
    """The discrepancy ``a − D`` the measured rounding predicts along the direction ``Σ_T w_T g_T`` over ``tensors``:
    ``Σ_T w_T (e_T · g_T)``, with ``rounding[T] = e_T · g_T`` (0 without a measured rounding)."""
    if rounding is None:
        return 0.0
    value = math.fsum(w * rounding[i] for i, w in zip(tensors, weights, strict=True))
    return value if math.isfinite(value) else 0.0


def vouchers(measured: Sequence[Measured]) -> list[Combined]:
    """The probes as they vouch for the tensors (:func:`~.combined.unvouched`, :func:`~.combined.tensors_to_probe`).

    Once the rounding is measured, and every probe's discrepancy less the part of it the rounding explains is within
    :data:`~.combined.CLOSER_LOOK` of the tolerance with the floor at the storage rounding (``exact_tolerance``), the
    probes vouch at that tolerance: a fault of a tensor that its own probe would resolve moves that discrepancy by at
    least half its tolerance, sending the check back to the probes at their own tolerance (with their groups and
    tensor probes); the rounding is not the fault. A float32 CNN at initialisation, whose convolutions before BatchNorm
    have floors a thousand times the rest, then needs no group or tensor probe for its precise tensors. Else, or
    without a measured rounding, the probes vouch at their own tolerance."""
    exact = [m.exact() for m in measured]
    chosen = [c for c in exact if c is not None and c.verdict == "ok" and c.excess <= CLOSER_LOOK]
    if measured and len(chosen) == len(measured):
        return chosen
    return [m.combined() for m in measured]


@dataclass(frozen=True)
class Rounding:
    """What the float64 gradient tells of the applied one without a probe, per tensor along its applied gradient
    ``g_T``: ``eager[T] = (eager_T − float64_T) · g_T`` (the path's rounding) and ``path[T] = (g_T − eager_T) · g_T``
    (how far the applied gradient is from the eager one: another rounding of the same path, or a fault of the
    training's path)."""

    eager: Sequence[float]
    path: Sequence[float]

    def beyond(self, grad_norms: Sequence[float], floors: Sequence[float], multiple: float) -> list[int]:
        """The tensors whose own probe the known parts alone, ``|eager[T] + path[T]| / ‖g_T‖``, would take beyond
        :data:`~.combined.CLOSER_LOOK` of its tolerance at the floor (``multiple · floor_T``): probed one by one, with
        their ``path`` part left in the combined probes' closer look (a fault of the training's path shows there); not
        those whose own probe resolves nothing smaller than their gradient (:func:`~.combined.unvouched`)."""
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
        the applied gradient's distance from the eager one where it keeps each tensor probe within half its tolerance
        (no tensor probe could fail by it: it is the floor's own kind of distance)."""
        left = set(beyond)
        return [e + (0.0 if i in left else p) for i, (e, p) in enumerate(zip(self.eager, self.path, strict=True))]


def off_eager(
    applied: Sequence[Tensor],
    eager: Sequence[Tensor],
    grad_norms: Sequence[float],
    floors: Sequence[float],
    multiple: float,
) -> list[int]:
    """On a 16-bit path, the tensors whose applied gradient ``g_T`` is further from eager float32 autograd's along
    ``ĝ_T``, ``|(g_T − eager_T) · ĝ_T|``, than :data:`~.combined.CLOSER_LOOK` of its own probe's tolerance at the floor
    (``multiple · floor_T``): a fault in one tensor's 16-bit backward shows there whole, however small its share of
    ``‖g‖``, where a combined probe over every tensor sums all their floors and a tensor probe in turn may not reach it
    at this check. Each is probed on its own; a correct path's rounding stays within its floor (the floor is a bound of
    it), so a healthy check rarely probes one more. Not those whose own probe resolves nothing smaller than their
    gradient."""
    limit = CLOSER_LOOK * multiple
    found = []
    for i, (g, e, size, floor) in enumerate(zip(applied, eager, grad_norms, floors, strict=True)):
        if not (size > 0 and math.isfinite(size)) or multiple * floor >= size:
            continue
        along = abs(dot(g.double() - e.double(), g.double())) / size
        if not along <= limit * floor:
            found.append(i)
    return found


def calm(measured: Sequence[Measured]) -> bool:
    """Whether every probe agrees, its discrepancy beyond the measured rounding within :data:`~.combined.CLOSER_LOOK`
    of its tolerance."""
    return all(m.probe.verdict == "ok" and m.closer <= CLOSER_LOOK for m in measured)
