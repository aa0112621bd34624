"""Bugs at special points of a smooth loss (logit 0, an exact zero factor, a sample exactly on the border) are caught,
though a shifted point does not show them; ties at the point stay clean (``test_confirmation.py``)."""

from __future__ import annotations

import pytest
import torch
from special_point_models import CASES

from gradwatch import check_gradients
from gradwatch.engine.numerics.kinks import at_a_tie, one_sided_jumps, smooth_at_the_point
from gradwatch.engine.numerics.stencil import Point, Stencil


def _stencil(phi: object, analytic: float, h: float = 1e-3) -> Stencil:
    """The full stencil of ``phi`` (a function of the offset) around 0."""
    points = tuple(Point(t, phi(t), t, analytic * t) for t in (h, -h, h / 2, -h / 2))  # type: ignore[operator]
    return Stencil(h, phi(0.0), analytic, points)  # type: ignore[operator]


def test_a_kink_keeps_its_jump_at_both_steps_and_a_smooth_point_halves_it() -> None:
    kink = _stencil(lambda t: 2.0 * t if t > 0 else 0.5 * t, analytic=2.0)
    jumps = one_sided_jumps(kink)
    assert jumps == pytest.approx((1.5, 1.5))
    assert not smooth_at_the_point(kink)
    smooth = _stencil(lambda t: 1.0 + 0.7 * t + 3.0 * t * t, analytic=0.9)
    jumps = one_sided_jumps(smooth)
    assert jumps[0] == pytest.approx(2 * jumps[1])
    assert smooth_at_the_point(smooth)


def test_round_off_is_not_taken_for_smoothness() -> None:
    noise = iter([3e-13, -2e-13, 1e-13, 4e-13, -3e-13])
    noisy = _stencil(lambda t: 1.0 + 0.5 * t + next(noise), analytic=0.6)
    assert not smooth_at_the_point(noisy)


def test_a_kink_is_a_tie_and_a_wrong_slope_on_a_smooth_loss_is_not() -> None:
    assert at_a_tie(_stencil(lambda t: 2.0 * t if t > 0 else 0.5 * t, analytic=2.0))
    assert at_a_tie(_stencil(lambda t: 1.0 + (2.0 * t if t > 0 else 0.5 * t), analytic=3.0))
    assert not at_a_tie(_stencil(lambda t: 1.0 + 0.7 * t + 3.0 * t * t, analytic=1.05))


def test_jumps_of_a_few_ulps_of_the_loss_are_no_tie() -> None:
    # measured (a Trainer run, SiLU Llama, a gate's gradient scaled by 1.5): the loss is linear along the probe at
    # this step, the one-sided jumps are 2 and 1 float64 ulps of the loss over the step, the same at both steps and
    # far above the stencil's odd residual (0.0), and autograd's slope is 1.5x the numeric one
    h, center, analytic = 1.5051767978520828e-07, 4.1789990263978645, 0.05634652149321058
    values = (4.178999032057488, 4.178999020738242, 4.178999029227676, 4.178999023568053)
    alongs = (h, -h, h / 2, -h / 2)
    points = tuple(Point(a / h, v, a, analytic * a) for v, a in zip(values, alongs, strict=True))
    stencil = Stencil(h, center, analytic, points)
    jumps = one_sided_jumps(stencil)
    assert jumps[0] == pytest.approx(jumps[1])
    assert stencil.odd_residual == 0.0
    assert not at_a_tie(stencil)


@pytest.mark.parametrize("name", list(CASES), ids=["bce-logit-0", "segment-product-zero", "grid-sample-border"])
def test_a_backward_wrong_only_at_a_special_point_fails(name: str) -> None:
    build, batch, loss = CASES[name]
    torch.manual_seed(0)
    report = check_gradients(build(), batch(torch.Generator().manual_seed(100)), loss, step=0, probe_batch_size=2)
    assert report.verdict == "fail", str(report)
    assert not any(p.reason == "tie" for p in report.failures)


@pytest.mark.parametrize("name", list(CASES), ids=["bce-logit-0", "segment-product-zero", "grid-sample-border"])
def test_the_same_models_with_a_correct_backward_pass(name: str) -> None:
    build, batch, loss = CASES[name]
    torch.manual_seed(0)
    report = check_gradients(
        build(correct=True), batch(torch.Generator().manual_seed(100)), loss, step=0, probe_batch_size=2
    )
    assert report.verdict == "ok", str(report)
