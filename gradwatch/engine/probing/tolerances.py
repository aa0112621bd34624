"""Tolerances per tensor, where the noise floor of a correct gradient was measured per tensor (a 16-bit model:
:mod:`gradwatch.engine.recomputed.sixteen_bit_floor`).

A correct 16-bit gradient is not equally far off everywhere: on a small bf16 CNN (ReLU, max-pool, BatchNorm) a
convolution's weight gradient before BatchNorm was 5-14% off the exact one (the real bf16 gradient as much as the
emulated one: 16-bit rounding moves the kinks of its ReLUs and pools, and BatchNorm's backward subtracts large
near-equal terms), its classifier's 0.4-0.6%. One tolerance for every probe, three times the largest relative floor,
was then the fixed cap (0.1 for bf16) in most checks, and a 5% bug in the classifier's gradient read ``ok``.
:class:`TensorTolerances` judges each probe against the floors of the tensors it moves instead:

* a probe within one tensor ``T`` (along its gradient, a random direction in it, a coordinate): ``multiple`` times
  ``floor_T / max(‖g_T‖, ν‖g‖)``, the relative floor the single tolerance took the largest of (``ν``: the fraction of
  the whole gradient below which the probes floor their relative errors);
* a probe along a direction ``v`` over several tensors (the descent probe, a cover probe): a correct gradient is off
  along ``v`` by at most ``Σ_T ‖v_T‖ · floor_T`` (Cauchy-Schwarz in each tensor), so ``multiple`` times that over the
  probe's scale (its slope, or the size of its tensors' contributions);

each tensor allowed at least the rounding of a gradient of a loss this near zero relative to its own gradient
(:func:`~gradwatch.engine.numerics.steps.gradient_tolerance`), each probe's tolerance between float32's and ``highest``.
A probe of anything else (inputs, activations) keeps the single tolerance.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass
from functools import cached_property

import torch

from gradwatch.engine.measuring.directions import VectorDirection
from gradwatch.engine.numerics.norms import norms
from gradwatch.engine.numerics.steps import gradient_tolerance
from gradwatch.engine.probing.tasks import ProbeTask


@dataclass(frozen=True)
class TensorTolerances:
    """The tolerances of one check's probes (see the module doc) from ``floors``, per checked parameter how far a
    correct gradient of it is off (a norm), and its ``grad_norms``: ``multiple`` floors, between ``lowest`` (float32's)
    and ``highest``, raised for a ``loss`` near zero in ``dtype``; ``negligible`` is ``ν``."""

    floors: tuple[float, ...]
    grad_norms: tuple[float, ...]
    multiple: float
    _: KW_ONLY
    lowest: float
    highest: float
    loss: float
    dtype: torch.dtype
    negligible: float

    def _bounded(self, relative: float) -> float:
        return min(self.highest, max(self.lowest, relative)) if math.isfinite(relative) else self.highest

    @cached_property
    def allowed(self) -> list[float]:
        """Per tensor, how far off (a norm) its gradient may be: ``multiple`` floors, and at least the rounding of a
        gradient of a loss this close to zero relative to the tensor's own gradient."""
        least = gradient_tolerance(self.lowest, self.loss, self.dtype)
        return [max(self.multiple * f, least * n) for f, n in zip(self.floors, self.grad_norms, strict=True)]

    @cached_property
    def per_tensor(self) -> list[float]:
        """The tolerance of a probe within each tensor."""
        smallest = self.negligible * math.hypot(*self.grad_norms)
        return [
            self._bounded(e / max(n, smallest)) if max(n, smallest) > 0 else self.highest
            for e, n in zip(self.allowed, self.grad_norms, strict=True)
        ]

    def of(self, task: ProbeTask) -> float | None:
        """The tolerance of ``task`` (``None``: the check's single one, for a probe of inputs or activations)."""
        moves = task.moves
        if not moves or not all(isinstance(m, int) and 0 <= m < len(self.floors) for m in moves):
            return None
        tensors = [m for m in moves if isinstance(m, int)]
        if len(tensors) == 1:
            return self.per_tensor[tensors[0]]
        direction = task.direction
        if not isinstance(direction, VectorDirection) or len(direction.components) != len(tensors):
            return None
        factors, sizes = direction.weights or [1.0] * len(tensors), norms(direction.components, exact=True)
        parts = [abs(direction.coefficient * w) * n for w, n in zip(factors, sizes, strict=True)]
        bound = sum(p * self.allowed[i] for p, i in zip(parts, tensors, strict=True))
        scale = max(abs(direction.analytic), task.scale_floor)
        return self._bounded(bound / scale) if scale > 0 else self.highest


def task_rtol(task: ProbeTask, default: float, tolerances: TensorTolerances | None) -> float:
    """The tolerance ``task`` is judged with: its own from ``tolerances`` (resolved once, kept on the task), else
    ``default``."""
    if tolerances is None:
        return default
    if task.rtol is None:
        task.rtol = tolerances.of(task)
    return default if task.rtol is None else task.rtol
