"""Steps and tolerances by dtype."""

from __future__ import annotations

import math

import pytest
import torch

from gradwatch.engine.numerics.steps import SIXTEEN_BIT_DIRECTION_STEP, finer_step, relative_step, relative_tolerance


def test_tolerances_and_steps_follow_the_dtype() -> None:
    assert relative_tolerance(torch.float64) < relative_tolerance(torch.float32) < relative_tolerance(torch.bfloat16)
    assert relative_step(torch.float32) == pytest.approx(torch.finfo(torch.float32).eps ** 0.2)
    assert relative_step(torch.float64) < relative_step(torch.float32)
    assert relative_step(torch.float64, torch.float64) == relative_step(torch.float64)


def test_sixteen_bit_probes_along_a_direction_step_longer_than_at_a_coordinate() -> None:
    # a direction over n coordinates moves each by ~1/√n of the step: in 16 bits its round-off is what limits it
    for dtype in (torch.bfloat16, torch.float16):
        at_a_coordinate = torch.finfo(dtype).eps ** 0.2
        assert relative_step(dtype) == pytest.approx(at_a_coordinate)
        assert relative_step(dtype, direction=True) == pytest.approx(SIXTEEN_BIT_DIRECTION_STEP * at_a_coordinate)
    for dtype in (torch.float32, torch.float64):  # their round-off leaves the Richardson optimum as it is
        assert relative_step(dtype, direction=True) == relative_step(dtype)
    assert relative_step(torch.float64, torch.bfloat16, direction=True) == relative_step(torch.float64, torch.bfloat16)


def test_float64_probes_of_a_float32_gradient_take_the_screens_optimal_step() -> None:
    # round-off is far below a float32 tolerance there: the two-point optimum ε^(1/3) leaves screens less truncation
    step = relative_step(torch.float64, torch.float32)
    assert step == pytest.approx(torch.finfo(torch.float64).eps ** (1 / 3))
    assert relative_step(torch.float64, torch.bfloat16) == step
    exp_screen = (math.exp(step) - math.exp(-step)) / (2 * step)  # d/dx exp at 0, truncation step²/6
    assert abs(exp_screen - 1.0) < 1e-9
    coarse = relative_step(torch.float64)
    assert abs((math.exp(coarse) - math.exp(-coarse)) / (2 * coarse) - 1.0) > 1e-8


def test_finer_step_goes_as_far_as_round_off_allows() -> None:
    # float64 values resolve a float32 tolerance at a step 64 times smaller; float32 values do not leave that room
    f64 = finer_step(1e-4, center=2.0, scale=0.1, rtol=5e-4, compute_epsilon=torch.finfo(torch.float64).eps)
    assert f64 == pytest.approx(1e-4 / 64)
    f32 = finer_step(0.1, center=2.0, scale=1.0, rtol=5e-4, compute_epsilon=torch.finfo(torch.float32).eps)
    assert f32 is not None
    assert 0.1 / 64 < f32 < 0.1 / 2  # floored where the round-off would approach the tolerance
    assert finer_step(1e-3, center=2.0, scale=1.0, rtol=5e-4, compute_epsilon=torch.finfo(torch.float32).eps) is None
    assert finer_step(1e-3, center=2.0, scale=0.0, rtol=5e-4, compute_epsilon=1e-16) is None
