"""The measuring service: points evaluated ahead are the points evaluated one by one, and a float64 re-measurement
leaves the check as it found it."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import classification_batch, cross_entropy_loss
from torch import nn

from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.function.precision import float64_storage
from gradwatch.engine.function.state import TrainingState
from gradwatch.engine.measuring.directions import VectorDirection
from gradwatch.engine.measuring.points import Measurements, measure
from gradwatch.engine.results.notes import NoteCode, codes


def _setup(dtype: torch.dtype) -> tuple[nn.Module, LossEvaluator]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)).to(dtype)
    inputs, labels = classification_batch()
    batch = (inputs.to(dtype), labels)
    params = list(model.named_parameters())
    return model, LossEvaluator(model, batch, cross_entropy_loss, params, TrainingState.capture(model))


def _direction(evaluator: LossEvaluator, position: int) -> VectorDirection:
    param = evaluator.params[position][1]
    grad = torch.randn_like(param)
    return VectorDirection([param], [grad], [grad], 1.0 / grad.norm().item())


def test_points_evaluated_ahead_are_the_points_evaluated_one_by_one() -> None:
    _, evaluator = _setup(torch.float64)
    measurements = Measurements(evaluator, evaluator.loss())
    measurements.start_vectorizing()
    assert measurements.vectorized is not None
    directions = [_direction(evaluator, i) for i in range(4)]
    measurements.prefetch([(d, 1e-4, (1.0, -1.0)) for d in directions])
    passes = evaluator.n_passes
    ahead = [measurements.points(d, 1e-4, (1.0, -1.0)) for d in directions]
    assert evaluator.n_passes == passes  # all of them were known
    assert measurements.vectorized_outcome is True
    for direction, points in zip(directions, ahead, strict=True):
        one_by_one = measure(evaluator, direction, 1e-4, (1.0, -1.0))
        for a, b in zip(points, one_by_one, strict=True):
            assert a.value == pytest.approx(b.value, rel=1e-13)
            assert a.along == pytest.approx(b.along, rel=1e-9)


def test_without_vectorised_passes_points_are_evaluated_when_asked_for() -> None:
    _, evaluator = _setup(torch.float32)
    measurements = Measurements(evaluator, evaluator.loss())
    measurements.start_vectorizing()  # float32 storage: not vectorised
    assert measurements.vectorized is None
    direction = _direction(evaluator, 0)
    measurements.prefetch([(direction, 1e-2, (1.0, -1.0))])
    passes = evaluator.n_passes
    stencil = measurements.stencil(direction, 1e-2, (1.0, -1.0))
    assert evaluator.n_passes == passes + 2
    assert stencil.center == measurements.center
    assert stencil.analytic == direction.analytic


def test_a_float64_remeasurement_puts_the_centre_dtype_and_inputs_back() -> None:
    model, evaluator = _setup(torch.float32)
    center = evaluator.loss()
    measurements = Measurements(evaluator, center)
    inputs = dict(evaluator.inputs)
    with measurements.in_float64(center, torch.float32) as substitutes:
        assert substitutes is not None
        assert measurements.compute_dtype == torch.float64
        assert measurements.center == pytest.approx(center, rel=1e-6)
        assert all(t.dtype == torch.float64 for t in evaluator.inputs.values())
    assert (measurements.center, measurements.compute_dtype) == (center, torch.float32)
    assert all(t.dtype == torch.float32 for t in evaluator.inputs.values())
    assert evaluator.inputs.keys() == inputs.keys()
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_float64_centre_that_is_another_function_gives_no_substitutes() -> None:
    _, evaluator = _setup(torch.float32)
    center = evaluator.loss()
    measurements = Measurements(evaluator, center)
    with measurements.in_float64(center + 1.0, torch.float32) as substitutes:
        assert substitutes is None
    assert NoteCode.NO_FLOAT64_REMEASUREMENT in codes(evaluator.notes)
    assert not math.isnan(measurements.center)


def test_float64_storage_substitutes_without_touching_the_parameters() -> None:
    model, _ = _setup(torch.float32)
    before = {name: (id(p), p.dtype) for name, p in model.named_parameters()}
    with float64_storage(model) as substitutes:
        assert {t.dtype for t in substitutes.values()} == {torch.float64}
    assert {name: (id(p), p.dtype) for name, p in model.named_parameters()} == before
