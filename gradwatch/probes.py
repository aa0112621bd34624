"""Moving the loss along one direction and recording what it does: the measurements behind every probe.

A probe perturbs either one coordinate (of a parameter, or of a floating input through the evaluator's working copy)
or every parameter at once along the normalised gradient ``ĝ`` (the descent probe). At each point it records the loss,
the displacement that float arithmetic actually produced along the direction, and autograd's first-order prediction of
the loss change for that displacement. :mod:`gradwatch.numerics` turns a set of such points into a verdict.

Perturbed values are always restored by copying the saved originals back, inside ``finally``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from gradwatch.evaluation import LossEvaluator
from gradwatch.numerics import Stencil


@dataclass(frozen=True)
class Displacement:
    """Where a perturbation actually landed: ``along`` is the displacement's component along the intended direction,
    ``predicted`` autograd's first-order loss change ``g · δ`` for the whole displacement ``δ``."""

    along: float
    predicted: float


class CoordinateDirection:
    """One coordinate ``tensor[index]``; its analytic derivative is ``gradient``.

    Args:
        tensor: A parameter, or a working input of the evaluator.
        index: The coordinate.
        gradient: The analytic derivative at that coordinate (0 when autograd gave none).
        after_write: Called after every write to ``tensor`` (the evaluator tracks in-place changes of its inputs).
    """

    def __init__(
        self,
        tensor: Tensor,
        index: tuple[int, ...],
        gradient: float,
        after_write: Callable[[], None] | None = None,
    ) -> None:
        self.tensor = tensor
        self.index = index
        self.analytic = gradient
        self.value = tensor.detach()[index].clone()
        self._after_write = after_write

    @contextmanager
    def displaced(self, offset: float) -> Iterator[Displacement]:
        """Set the coordinate to ``value + offset`` as represented in its dtype; yield the displacement obtained."""
        origin = self.value.double()
        moved = (origin + offset).to(self.tensor.dtype)
        actual = (moved.double() - origin).item()
        try:
            self._write(moved)
            yield Displacement(actual, self.analytic * actual)
        finally:
            self._write(self.value)

    def _write(self, value: Tensor) -> None:
        with torch.no_grad():
            self.tensor[self.index] = value
        if self._after_write is not None:
            self._after_write()


class GradientDirection:
    """All parameters at once, along ``ĝ = g/‖g‖``; the analytic slope along it is ``‖g‖``.

    From its first displacement on it holds one copy of the parameters' original values, so that every restore is an
    exact copy; the copy goes with the object.
    """

    def __init__(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
        self.params = list(params)
        self.grads = list(grads)
        self.norm = math.sqrt(sum(torch.linalg.vector_norm(g, dtype=torch.float64).item() ** 2 for g in self.grads))
        self.analytic = self.norm
        self._origin: list[Tensor] | None = None

    @contextmanager
    def displaced(self, offset: float) -> Iterator[Displacement]:
        """Move every parameter by ``offset · ĝ`` (rounded to its dtype); yield the displacement obtained."""
        if self._origin is None:
            self._origin = [p.detach().clone() for p in self.params]
        saved = self._origin
        predicted = 0.0
        try:
            with torch.no_grad():
                for param, origin, grad in zip(self.params, saved, self.grads, strict=True):
                    moved = (origin.double() + (offset / self.norm) * grad.double()).to(param.dtype)
                    delta = moved.double() - origin.double()
                    param.copy_(moved)
                    predicted += (grad.double() * delta).sum().item()
            # the component along ĝ is g·δ / ‖g‖
            yield Displacement(predicted / self.norm, predicted)
        finally:
            with torch.no_grad():
                for param, origin in zip(self.params, saved, strict=True):
                    param.copy_(origin)


Direction = CoordinateDirection | GradientDirection

STENCIL_OFFSETS = (1.0, -1.0, 0.5, -0.5)
"""The points of a probe, in units of its step ``h``: a central difference at ``h`` and another at ``h/2``."""


def measure(evaluator: LossEvaluator, direction: Direction, step: float, center: float) -> Stencil:
    """Evaluate the loss at ``±step`` and ``±step/2`` along ``direction``; ``center`` is the loss at the origin."""
    along = []
    predicted = []
    values = []
    for fraction in STENCIL_OFFSETS:
        with direction.displaced(fraction * step) as displacement:
            values.append(evaluator.loss())
        along.append(displacement.along)
        predicted.append(displacement.predicted)
    return Stencil(
        step=step,
        center=center,
        analytic=direction.analytic,
        values=tuple(values),
        along=tuple(along),
        predicted=tuple(predicted),
    )
