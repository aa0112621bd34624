"""Finite-difference arithmetic on functions whose derivatives are known exactly."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from gradwatch.numerics import (
    Assessment,
    Point,
    Stencil,
    assess,
    confirm,
    finer_step,
    relative_step,
    relative_tolerance,
    screen,
)

OFFSETS = (1.0, -1.0, 0.5, -0.5)


def stencil(f: Callable[[float], float], analytic: float, step: float, offsets: tuple[float, ...] = OFFSETS) -> Stencil:
    """The stencil of ``f`` around 0 with exact displacements; ``analytic`` plays autograd's derivative."""
    points = tuple(Point(o, f(o * step), o * step, analytic * o * step) for o in offsets)
    return Stencil(step=step, center=f(0.0), analytic=analytic, points=points)


def judge(s: Stencil, rtol: float = 1e-6) -> Assessment:
    return assess(s, rtol=rtol, scale_floor=0.0, value_epsilon=2.2e-16)


def test_richardson_is_exact_for_quartics_and_residuals_vanish() -> None:
    def quartic(t: float) -> float:
        return 1.0 + 2.0 * t + 3.0 * t**2 - 4.0 * t**3 + 5.0 * t**4

    s = stencil(quartic, analytic=2.0, step=0.1)
    assert s.numeric == pytest.approx(2.0, abs=1e-13)
    assert s.richardson == pytest.approx(0.0, abs=1e-13)
    # e(h) - e(h/2) is the h^2 truncation term: (h^2 - h^2/4) * f'''/6
    assert s.odd_residual == pytest.approx((0.01 - 0.0025) * (-24.0) / 6, rel=1e-9)
    # the fourth difference of a quartic: (1 - 4/16) * 2 * 5 * h^4 ... exactly 24 * 5 * (h/2)^4
    assert s.even_residual == pytest.approx(24 * 5 * 0.05**4, rel=1e-6)


def test_displacement_that_missed_the_intended_point_is_accounted_for() -> None:
    # the step landed at 0.1000003 instead of 0.1: using the actual displacement keeps the estimate exact
    along = (0.1000003, -0.1, 0.05, -0.05)
    points = tuple(Point(o, 3.0 * a, a, 3.0 * a) for o, a in zip(OFFSETS, along, strict=True))
    s = Stencil(step=0.1, center=0.0, analytic=3.0, points=points)
    assert s.numeric == pytest.approx(3.0, abs=1e-14)


def test_correct_derivative_of_a_smooth_function_is_ok() -> None:
    a = judge(stencil(math.exp, analytic=1.0, step=relative_step(torch.float64)))
    assert (a.verdict, a.reason) == ("ok", "agrees")
    assert a.rel_error < 1e-10


def test_wrong_derivative_is_a_discrepancy() -> None:
    a = judge(stencil(math.exp, analytic=1.01, step=relative_step(torch.float64)))
    assert (a.verdict, a.reason) == ("fail", "discrepancy")
    assert a.rel_error == pytest.approx(0.01 / 1.01, rel=1e-6)


def test_kink_at_the_point_is_inconclusive_not_a_failure() -> None:
    # relu at 0: autograd says 0 (or 1), the central difference says 1/2 at every step
    a = judge(stencil(lambda t: max(t, 0.0), analytic=0.0, step=1e-3))
    assert (a.verdict, a.reason) == ("inconclusive", "kink")


def test_kink_inside_the_stencil_is_inconclusive() -> None:
    a = judge(stencil(lambda t: abs(t - 3e-4) + t, analytic=0.0, step=1e-3))
    assert a.verdict == "inconclusive"


def test_noisy_function_is_unresolved_not_a_failure() -> None:
    jitter = dict(zip([0.0, *OFFSETS], [0.0, 3e-7, -2e-7, -4e-7, 1e-7], strict=True))
    a = judge(stencil(lambda t: 2.0 * t + jitter[t / 1e-3 if t else 0.0], analytic=2.0, step=1e-3), rtol=1e-4)
    assert a.verdict == "inconclusive"


def test_flat_loss_with_a_nonzero_analytic_derivative_is_inconclusive() -> None:
    a = judge(stencil(lambda t: 0.25, analytic=1e-7, step=1e-3))
    assert (a.verdict, a.reason) == ("inconclusive", "flat")


def test_flat_loss_with_a_zero_analytic_derivative_is_ok() -> None:
    a = judge(stencil(lambda t: 0.25, analytic=0.0, step=1e-3))
    assert (a.verdict, a.reason) == ("ok", "agrees")


def test_flat_loss_with_a_negligible_analytic_derivative_is_ok() -> None:
    # a bias feeding BatchNorm: the true derivative is 0, autograd returns float noise far below the model's scale
    s = stencil(lambda t: 0.25, analytic=1e-17, step=1e-3)
    assert assess(s, rtol=1e-6, scale_floor=1e-8, value_epsilon=2.2e-16).verdict == "ok"
    assert assess(s, rtol=1e-6, scale_floor=1e-12, value_epsilon=2.2e-16).reason == "flat"


def test_nonfinite_values_are_inconclusive() -> None:
    a = judge(stencil(lambda t: math.log(t) if t > 0 else math.nan, analytic=1.0, step=1e-3))
    assert (a.verdict, a.reason) == ("inconclusive", "nonfinite")


def test_scale_floor_keeps_a_zero_gradient_from_reading_as_a_100_percent_error() -> None:
    s = stencil(lambda t: 1e-12 * t, analytic=0.0, step=1e-3)
    assert judge(s).rel_error == pytest.approx(1.0)
    floored = assess(s, rtol=1e-6, scale_floor=1e-3, value_epsilon=2.2e-16)
    assert floored.rel_error == pytest.approx(1e-9)
    assert floored.verdict == "ok"


def test_screen_that_agrees_within_the_borrowed_noise_is_ok() -> None:
    s = stencil(math.exp, analytic=1.0, step=1e-4, offsets=(1.0, -1.0))
    a = screen(s, rtol=1e-6, scale_floor=0.0, value_epsilon=2.2e-16, loss_noise=1e-15)
    assert (a.verdict, a.reason) == ("ok", "agrees")
    assert a.noise == pytest.approx(1e-15 / 1e-4 + 2.2e-16 / 1e-4, rel=0.01)  # borrowed noise + quantum


def test_screen_with_a_significant_discrepancy_is_suspect_not_failed() -> None:
    s = stencil(math.exp, analytic=1.01, step=1e-4, offsets=(1.0, -1.0))
    a = screen(s, rtol=1e-6, scale_floor=0.0, value_epsilon=2.2e-16, loss_noise=1e-15)
    assert (a.verdict, a.reason) == ("suspect", "discrepancy")


def test_screen_beyond_the_tolerance_is_suspect_even_when_drowned_in_the_borrowed_noise() -> None:
    s = stencil(math.exp, analytic=1.01, step=1e-4, offsets=(1.0, -1.0))
    a = screen(s, rtol=1e-6, scale_floor=0.0, value_epsilon=2.2e-16, loss_noise=1e-5)
    assert (a.verdict, a.reason) == ("suspect", "unresolved")


def test_screen_within_the_tolerance_but_drowned_in_noise_is_inconclusive() -> None:
    s = stencil(math.exp, analytic=1.0, step=1e-4, offsets=(1.0, -1.0))
    a = screen(s, rtol=1e-6, scale_floor=0.0, value_epsilon=2.2e-16, loss_noise=1e-5)
    assert (a.verdict, a.reason) == ("inconclusive", "unresolved")


def test_jitter_raises_the_noise_of_a_full_stencil() -> None:
    s = stencil(math.exp, analytic=1.0, step=relative_step(torch.float64))
    quiet = assess(s, rtol=1e-6, scale_floor=0.0, value_epsilon=2.2e-16)
    jittery = assess(s, rtol=1e-6, scale_floor=0.0, value_epsilon=2.2e-16, jitter=1e-9)
    assert jittery.noise > quiet.noise + 1e-9 / s.step


def _assessment(verdict: str, discrepancy: float, reason: str = "discrepancy") -> Assessment:
    return Assessment(
        numeric=1.0 + discrepancy, discrepancy=discrepancy, noise=1e-6, scale=2.0, verdict=verdict, reason=reason
    )


def test_confirmed_discrepancy_stands() -> None:
    assert confirm(_assessment("fail", 0.10), _assessment("fail", 0.11)).verdict == "fail"


def test_discrepancy_that_does_not_reproduce_is_unstable() -> None:
    result = confirm(_assessment("fail", 0.10), _assessment("fail", -0.05))
    assert (result.verdict, result.reason) == ("inconclusive", "unstable")


def test_second_stencil_that_agrees_with_autograd_wins() -> None:
    assert confirm(_assessment("fail", 0.10), _assessment("ok", 1e-9, "agrees")).verdict == "ok"


def test_tolerances_and_steps_follow_the_dtype() -> None:
    assert relative_tolerance(torch.float64) < relative_tolerance(torch.float32) < relative_tolerance(torch.bfloat16)
    assert relative_step(torch.float32) == pytest.approx(torch.finfo(torch.float32).eps ** 0.2)
    assert relative_step(torch.float64) < relative_step(torch.float32)
    assert relative_step(torch.float64, torch.float64) == relative_step(torch.float64)


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
