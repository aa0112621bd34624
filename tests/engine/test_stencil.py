"""Stencils: Richardson extrapolation and residuals on functions whose derivatives are known exactly."""

from __future__ import annotations

import pytest
from helpers import exact_stencil

from gradwatch.engine.numerics.stencil import Point, Stencil

OFFSETS = (1.0, -1.0, 0.5, -0.5)


def test_richardson_is_exact_for_quartics_and_residuals_vanish() -> None:
    def quartic(t: float) -> float:
        return 1.0 + 2.0 * t + 3.0 * t**2 - 4.0 * t**3 + 5.0 * t**4

    s = exact_stencil(quartic, analytic=2.0, step=0.1)
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
