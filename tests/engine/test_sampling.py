"""Coordinate sampling: stratified by tensor, reproducible, covering every tensor in turn."""

from __future__ import annotations

import math

import pytest

from gradwatch.engine.probing.sampling import generator, sample_coordinates

SHAPES = [(1000, 1000), (10,), (256, 3, 3, 3), (1,), (0,), (7, 5)]


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 13])
def test_every_tensor_is_probed_within_a_few_checks(count: int) -> None:
    nonempty = [i for i, shape in enumerate(SHAPES) if math.prod(shape) > 0]
    checks = math.ceil(len(nonempty) / count)
    covered = set()
    for rotation in range(checks):
        coordinates = sample_coordinates(SHAPES, count, generator(0, rotation), rotation)
        assert len(coordinates) == count
        covered |= {c.tensor for c in coordinates}
    assert covered == set(nonempty)


def test_coordinates_are_valid_distinct_and_reproducible() -> None:
    first = sample_coordinates(SHAPES, 40, generator(3, 11), 0)
    again = sample_coordinates(SHAPES, 40, generator(3, 11), 0)
    assert first == again
    for c in first:
        shape = SHAPES[c.tensor]
        assert len(c.index) == len(shape)
        assert all(0 <= i < n for i, n in zip(c.index, shape, strict=True))
    big = [c.index for c in first if c.tensor == 0]
    assert len(big) == len(set(big))
    assert sum(c.tensor == 3 for c in first) == 1  # a 1-element tensor is probed once, not 8 times


def test_nothing_to_sample() -> None:
    assert sample_coordinates([], 5, generator(0, 0), 0) == []
    assert sample_coordinates([(0,)], 5, generator(0, 0), 0) == []
    assert sample_coordinates(SHAPES, 0, generator(0, 0), 0) == []
