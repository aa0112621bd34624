"""Finite-difference arithmetic on functions whose derivatives are known exactly."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from gradwatch.numerics import (
    Assessment,
    Stencil,
    assess,
    confirm,
    relative_step,
    relative_tolerance,
)

OFFSETS = (1.0, -1.0, 0.5, -0.5)


def stencil(f: Callable[[float], float], analytic: float, step: float) -> Stencil:
    """The stencil of ``f`` around 0 with exact displacements; ``analytic`` plays autograd's derivative."""
    along = tuple(fraction * step for fraction in OFFSETS)
    return Stencil(
        step=step,
        center=f(0.0),
        analytic=analytic,
        values=tuple(f(t) for t in along),
        along=along,
        predicted=tuple(analytic * t for t in along),
    )


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
    s = Stencil(
        step=0.1,
        center=0.0,
        analytic=3.0,
        values=(3.0 * 0.1000003, -3.0 * 0.1, 3.0 * 0.05, -3.0 * 0.05),
        along=(0.1000003, -0.1, 0.05, -0.05),
        predicted=(3.0 * 0.1000003, -3.0 * 0.1, 3.0 * 0.05, -3.0 * 0.05),
    )
    assert s.numeric == pytest.approx(3.0, abs=1e-14)


def test_correct_derivative_of_a_smooth_function_is_ok() -> None:
    a = judge(stencil(math.exp, analytic=1.0, step=relative_step(torch.float64)))
    assert (a.verdict, a.reason) == ("ok", "agrees")
    assert a.rel_error < 1e-10


def test_wrong_derivative_is_a_discrepancy() -> None:
    a = judge(stencil(math.exp, analytic=1.01, step=relative_step(torch.float64)))
    assert (a.verdict, a.reason) == ("fail", "discrepancy")
    assert a.rel_error == pytest.approx(0.01 / 2.01, rel=1e-6)


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
