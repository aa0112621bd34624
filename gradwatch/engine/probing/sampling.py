"""What a check probes: coordinates stratified by tensor, reproducible from a seed and the step; groups of tensors.

Sampling coordinates uniformly over all parameters would almost never touch a 10-element bias next to a 10^6-element
weight. Instead the tensors take turns: a check spreads its probes over a window of tensors, and successive checks move
the window along, so every tensor is probed once every ``ceil(n_tensors / n_probes)`` checks whatever its size. Within a
tensor the coordinate is uniform. Everything is drawn from a generator seeded by ``(seed, step)``, so every process of a
distributed run probes the same coordinates.

Cover probes (:func:`cover_groups`): every tensor's gradient checked at every check, its error weighed above the noise.

The descent probe moves all parameters along ``ĝ``: a tensor holding a fraction ``f`` of ``‖g‖²`` contributes ``f``
of its slope, so an error ``ε`` in that tensor's gradient shifts the slope by ``ε·f`` (a 2% error in a tensor with
``f = 2e-4`` is a 4e-6 discrepancy, far below any tolerance). Tensor probes see each tensor at full weight but only in
turn. A cover probe moves a *group* of tensors along

    ``d = Σ_T s_T · a_T · g_T/‖g_T‖``,  ``a_T = 1 / max(‖g_T‖, ν‖g‖)``,  ``s_T = ±1``,

so that each tensor contributes ``c_T = s_T · ‖g_T‖ / max(‖g_T‖, ν‖g‖)`` (``±1`` unless its gradient is negligible,
below ``ν = ε_native^(1/3)`` of the whole, where tensor probes floor their errors too) to the slope ``g·d``.
An error ``ε`` in tensor ``T`` moves the slope by ``ε·c_T``. The probe's relative error is taken against
``√(Σ c_T²)`` (its scale floor), the size that independent per-tensor rounding errors of autograd add up to, so the
check's tolerance keeps its meaning; the signs are chosen to balance the sum (``|Σ s_T c_T| ≤ 1``), so the slope
itself does not hide the error. A wrong gradient in any one tensor of a group of ``G`` tensors thus reads as a relative
error of at least ``ε / √G``.

Groups are sized so that an error of :data:`COVER_SENSITIVITY` in any one tensor reads as twice the tolerance:
``G ≤ (COVER_SENSITIVITY / (2·rtol))²`` (100 tensors for float32's 5e-4; one group for float64 models). Every tensor
with a gradient that the check's tensor probes do not reach is in exactly one group at every check (at most
:data:`MOST_COVER_PROBES` groups; a model with more tensors than that many groups hold gets larger groups and a
proportionally smaller sensitivity, which the docs state). A healthy check pays two loss evaluations per group.
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


COVER_SENSITIVITY = 0.01
"""The relative error in one tensor's gradient that a cover probe must show at twice the check's tolerance."""

MOST_COVER_PROBES = 8
"""At most this many cover probes per check; beyond ``8 × G`` tensors the groups grow instead."""


@dataclass(frozen=True)
class CoverGroup:
    """One cover probe's tensors (positions in the check's parameters) and their weights."""

    tensors: tuple[int, ...]
    weights: tuple[float, ...]  # the factor on each tensor's gradient in the unnormalised direction: s_T · a_T / ‖g_T‖
    norm: float  # ‖d‖ = √(Σ a_T²)
    contributions: float  # √(Σ c_T²): what the slope along d is judged against


def group_size(rtol: float) -> int:
    """The most tensors one cover probe groups under tolerance ``rtol``."""
    return max(2, int((COVER_SENSITIVITY / (2 * rtol)) ** 2)) if rtol > 0 else 1 << 30


def cover_groups(
    grad_norms: Sequence[float], candidates: Sequence[int], floor: float, rtol: float, rng: random.Random
) -> list[CoverGroup]:
    """``candidates`` (tensors with a non-zero gradient) split at random (``rng``: the same groups on every process)
    into groups for tolerance ``rtol``, each tensor weighed by its gradient norm; a norm below ``floor`` (``ν‖g‖``) is
    taken as it."""
    if not candidates:
        return []
    count = min(MOST_COVER_PROBES, math.ceil(len(candidates) / group_size(rtol)))
    shuffled = list(candidates)
    rng.shuffle(shuffled)
    return [_weighed(grad_norms, shuffled[k::count], floor) for k in range(count)]


def _weighed(grad_norms: Sequence[float], tensors: Sequence[int], floor: float) -> CoverGroup:
    weights, amplitudes, contributions = [], [], []
    running = 0.0
    for i in tensors:
        size = grad_norms[i]
        amplitude = 1.0 / max(size, floor)
        contribution = size * amplitude
        sign = -1.0 if running > 0 else 1.0  # balance the sum: |Σ s_T c_T| stays below the largest c_T
        running += sign * contribution
        weights.append(sign * amplitude / size)
        amplitudes.append(amplitude)
        contributions.append(contribution)
    return CoverGroup(tuple(tensors), tuple(weights), math.hypot(*amplitudes), math.hypot(*contributions))
