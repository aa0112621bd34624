"""Which coordinates a check probes: stratified by tensor, reproducible from a seed and the step.

Sampling coordinates uniformly over all parameters would almost never touch a 10-element bias next to a 10^6-element
weight. Instead the tensors take turns: a check spreads its probes over a window of tensors, and successive checks move
the window along, so every tensor is probed once every ``ceil(n_tensors / n_probes)`` checks whatever its size. Within a
tensor the coordinate is uniform. Everything is drawn from a generator seeded by ``(seed, step)``, so every process of a
distributed run probes the same coordinates.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Coordinate:
    """One sampled coordinate: ``tensor`` is a position in the list of shapes given to :func:`sample_coordinates`."""

    tensor: int
    index: tuple[int, ...]


def generator(seed: int, step: int) -> random.Random:
    """The random generator of one check: the same on every process for the same ``seed`` and ``step``."""
    return random.Random(f"gradwatch:{seed}:{step}")


def rotating_window(count: int, size: int, rotation: int) -> list[int]:
    """``size`` consecutive positions among ``count`` (wrapping around), starting at ``rotation × size``: successive
    rotations cover every position once every ``ceil(count / size)`` checks."""
    if count == 0 or size <= 0:
        return []
    if size >= count:
        return list(range(count))
    start = (rotation * size) % count
    return [(start + offset) % count for offset in range(size)]


def _unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat, position = divmod(flat, size)
        index.append(position)
    return tuple(reversed(index))


def sample_coordinates(
    shapes: Sequence[Sequence[int]],
    count: int,
    rng: random.Random,
    rotation: int,
) -> list[Coordinate]:
    """``count`` coordinates among tensors of the given ``shapes``, stratified: each of the ``n`` non-empty tensors gets
    ``count // n`` and the window of ``count % n`` tensors from ``rotation × count`` one more; distinct within a tensor
    while it has enough elements."""
    sizes = [math.prod(shape) for shape in shapes]
    candidates = [i for i, size in enumerate(sizes) if size > 0]
    if count <= 0 or not candidates:
        return []
    per_tensor = dict.fromkeys(candidates, count // len(candidates))
    start = (rotation * count) % len(candidates)
    for offset in range(count % len(candidates)):
        per_tensor[candidates[(start + offset) % len(candidates)]] += 1
    _redistribute_surplus(per_tensor, sizes)
    chosen = []
    for tensor, n in per_tensor.items():
        flats = rng.sample(range(sizes[tensor]), n)
        chosen += [Coordinate(tensor, _unravel(flat, shapes[tensor])) for flat in flats]
    return chosen


def _redistribute_surplus(per_tensor: dict[int, int], sizes: Sequence[int]) -> None:
    """Move the probes a tensor has no room for (more probes than elements) to tensors that have room."""
    surplus = 0
    for tensor, n in per_tensor.items():
        surplus += max(n - sizes[tensor], 0)
        per_tensor[tensor] = min(n, sizes[tensor])
    while surplus:
        roomy = [t for t in per_tensor if per_tensor[t] < sizes[t]]
        if not roomy:
            return
        for tensor in roomy[:surplus]:
            per_tensor[tensor] += 1
            surplus -= 1
