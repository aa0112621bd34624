"""Directions: moves that land where they say, and restores that are exact."""

from __future__ import annotations

import math

import pytest
import torch

from gradwatch.engine.measuring.directions import CoordinateDirection, VectorDirection


def test_vector_moves_overwrite_and_restore_exactly() -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(5, 3, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    grads = [torch.randn(5, 3), torch.randn(4)]
    originals = [t.clone() for t in tensors]
    size = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    direction = VectorDirection(tensors, grads, grads, 1.0 / size, components_norm=size)
    assert direction.analytic == pytest.approx(size, rel=1e-12)  # g · ĝ = ‖g‖
    with direction.moving() as move:
        first = move(0.5)
        after_first = [t.clone() for t in tensors]
        move(-0.25)
        for tensor, origin, grad in zip(tensors, originals, grads, strict=True):
            assert torch.equal(tensor, origin + (-0.25 / size) * grad.double())  # from the origin, not cumulative
    assert all(torch.equal(t, o) for t, o in zip(tensors, originals, strict=True))
    assert first.along == pytest.approx(0.5, rel=1e-12)
    assert first.predicted == pytest.approx(0.5 * size, rel=1e-12)
    # the same points written into rows of stacked copies: bit for bit what moving the tensors wrote
    rows = {id(t): torch.empty(2, *t.shape, dtype=t.dtype) for t in tensors}
    assert direction.displace_rows([0.5, -0.25], rows)[0] == first
    for tensor, moved, origin, grad in zip(tensors, after_first, originals, grads, strict=True):
        assert torch.equal(rows[id(tensor)][0], moved)
        assert torch.equal(rows[id(tensor)][1], origin + (-0.25 / size) * grad.double())
    assert all(torch.equal(t, o) for t, o in zip(tensors, originals, strict=True))


def test_coordinate_moves_by_what_the_dtype_represents_and_restores() -> None:
    tensor = torch.tensor([1.0, 2.0, 3.0])
    direction = CoordinateDirection(tensor, (1,), gradient=4.0)
    with direction.moving() as move:
        displacement = move(1e-9)  # below float32's resolution at 2.0: no move at all
        assert displacement.along == 0.0
        displacement = move(0.125)
        assert tensor[1].item() == 2.125
        assert displacement.predicted == 0.5
    assert tensor.tolist() == [1.0, 2.0, 3.0]
    rows = tensor.expand(2, 3).clone()
    assert direction.displace_rows([0.125, -0.5], {id(tensor): rows})[0] == displacement
    assert rows.tolist() == [[1.0, 2.125, 3.0], [1.0, 1.5, 3.0]]
    assert tensor.tolist() == [1.0, 2.0, 3.0]
