"""Verdicts from stencils of functions whose derivatives are known exactly: ok, fail, kinks, noise, flat losses,
screens and confirmations."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import exact_stencil

from gradwatch.engine.numerics.assessment import Assessment, assess, confirm, screen
from gradwatch.engine.numerics.stencil import Stencil
from gradwatch.engine.numerics.steps import relative_step

OFFSETS = (1.0, -1.0, 0.5, -0.5)


def judge(s: Stencil, rtol: float = 1e-6) -> Assessment:
    return assess(s, rtol=rtol, scale_floor=0.0, value_epsilon=2.2e-16)


def test_correct_derivative_of_a_smooth_function_is_ok() -> None:
    a = judge(exact_stencil(math.exp, analytic=1.0, step=relative_step(torch.float64)))
    assert (a.verdict, a.reason) == ("ok", "agrees")
    assert a.rel_error < 1e-10


def test_wrong_derivative_is_a_discrepancy() -> None:
    a = judge(exact_stencil(math.exp, analytic=1.01, step=relative_step(torch.float64)))
    assert (a.verdict, a.reason) == ("fail", "discrepancy")
    assert a.rel_error == pytest.approx(0.01 / 1.01, rel=1e-6)


def test_kink_at_the_point_is_inconclusive_not_a_failure() -> None:
    # relu at 0: autograd says 0 (or 1), the central difference says 1/2 at every step
    a = judge(exact_stencil(lambda t: max(t, 0.0), analytic=0.0, step=1e-3))
    assert (a.verdict, a.reason) == ("inconclusive", "kink")


def test_kink_inside_the_stencil_is_inconclusive() -> None:
    a = judge(exact_stencil(lambda t: abs(t - 3e-4) + t, analytic=0.0, step=1e-3))
    assert a.verdict == "inconclusive"


def test_noisy_function_is_unresolved_not_a_failure() -> None:
    jitter = dict(zip([0.0, *OFFSETS], [0.0, 3e-7, -2e-7, -4e-7, 1e-7], strict=True))
    a = judge(exact_stencil(lambda t: 2.0 * t + jitter[t / 1e-3 if t else 0.0], analytic=2.0, step=1e-3), rtol=1e-4)
    assert a.verdict == "inconclusive"


def test_flat_loss_with_a_nonzero_analytic_derivative_is_inconclusive() -> None:
    a = judge(exact_stencil(lambda t: 0.25, analytic=1e-7, step=1e-3))
    assert (a.verdict, a.reason) == ("inconclusive", "flat")


def test_flat_loss_with_a_zero_analytic_derivative_is_ok() -> None:
    a = judge(exact_stencil(lambda t: 0.25, analytic=0.0, step=1e-3))
    assert (a.verdict, a.reason) == ("ok", "agrees")


def test_flat_loss_with_a_negligible_analytic_derivative_is_ok() -> None:
    # a bias feeding BatchNorm: the true derivative is 0, autograd returns float noise far below the model's scale
    s = exact_stencil(lambda t: 0.25, analytic=1e-17, step=1e-3)
    assert assess(s, rtol=1e-6, scale_floor=1e-8, value_epsilon=2.2e-16).verdict == "ok"
    assert assess(s, rtol=1e-6, scale_floor=1e-12, value_epsilon=2.2e-16).reason == "flat"


def test_nonfinite_values_are_inconclusive() -> None:
    a = judge(exact_stencil(lambda t: math.log(t) if t > 0 else math.nan, analytic=1.0, step=1e-3))
    assert (a.verdict, a.reason) == ("inconclusive", "nonfinite")


def test_scale_floor_keeps_a_zero_gradient_from_reading_as_a_100_percent_error() -> None:
    s = exact_stencil(lambda t: 1e-12 * t, analytic=0.0, step=1e-3)
    assert judge(s).rel_error == pytest.approx(1.0)
    floored = assess(s, rtol=1e-6, scale_floor=1e-3, value_epsilon=2.2e-16)
    assert floored.rel_error == pytest.approx(1e-9)
    assert floored.verdict == "ok"


def test_screen_that_agrees_within_the_borrowed_noise_is_ok() -> None:
    s = exact_stencil(math.exp, analytic=1.0, step=1e-4, offsets=(1.0, -1.0))
    a = screen(s, rtol=1e-6, scale_floor=0.0, value_epsilon=2.2e-16, loss_noise=1e-15)
    assert (a.verdict, a.reason) == ("ok", "agrees")
    assert a.noise == pytest.approx(1e-15 / 1e-4 + 2.2e-16 / 1e-4, rel=0.01)  # borrowed noise + quantum


def test_screen_with_a_significant_discrepancy_is_suspect_not_failed() -> None:
    s = exact_stencil(math.exp, analytic=1.01, step=1e-4, offsets=(1.0, -1.0))
    a = screen(s, rtol=1e-6, scale_floor=0.0, value_epsilon=2.2e-16, loss_noise=1e-15)
    assert (a.verdict, a.reason) == ("suspect", "discrepancy")


def test_screen_beyond_the_tolerance_is_suspect_even_when_drowned_in_the_borrowed_noise() -> None:
    s = exact_stencil(math.exp, analytic=1.01, step=1e-4, offsets=(1.0, -1.0))
    a = screen(s, rtol=1e-6, scale_floor=0.0, value_epsilon=2.2e-16, loss_noise=1e-5)
    assert (a.verdict, a.reason) == ("suspect", "unresolved")


def test_screen_within_the_tolerance_but_drowned_in_noise_is_inconclusive() -> None:
    s = exact_stencil(math.exp, analytic=1.0, step=1e-4, offsets=(1.0, -1.0))
    a = screen(s, rtol=1e-6, scale_floor=0.0, value_epsilon=2.2e-16, loss_noise=1e-5)
    assert (a.verdict, a.reason) == ("inconclusive", "unresolved")


def test_jitter_raises_the_noise_of_a_full_stencil() -> None:
    s = exact_stencil(math.exp, analytic=1.0, step=relative_step(torch.float64))
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
