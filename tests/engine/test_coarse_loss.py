"""A loss rounded to float32 on the way (issue 44): a binding that computes its costs on the side and returns
``torch.FloatTensor([costs.sum()])`` delivers a float32 value whatever precision the probes compute in, so a float64
probe's central difference at a float64 step carries a noise as large as the slope. Such a probe once "agreed" with a
gradient 98% off within five times that noise (``-> ok``). A probe whose noise is comparable to its slope is now
``inconclusive`` (reason ``unresolved``), never ``ok``; the applied check measures such probes again at the step of
the loss's own dtype, which resolves them, so the 50% bug fails in both kinds of check and the correct binding
passes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gradwatch import check_applied_gradient, check_gradients
from gradwatch.engine.applied.verdict import judge
from gradwatch.engine.numerics.assessment import Assessment
from gradwatch.engine.numerics.stencil import Point, Stencil
from gradwatch.engine.results.notes import NoteCode


class Float32Binding(torch.autograd.Function):
    """A squared-error cost computed on the side (as a C binding does) and returned as a float32 copy of its sum; its
    backward returns the gradient the forward computed, times ``factor`` (1 is correct)."""

    @staticmethod
    def forward(ctx: Any, prediction: Tensor, target: Tensor, factor: float) -> Tensor:
        with torch.no_grad():
            difference = (prediction - target).double()
            costs = difference.square().sum(1)
        ctx.save_for_backward((2 * difference).to(prediction.dtype))
        ctx.factor = factor
        return torch.FloatTensor([costs.sum().item()])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (gradient,) = ctx.saved_tensors
        return grad.to(gradient.dtype) * gradient * ctx.factor, None, None


def _setup(factor: float, samples: int = 256) -> tuple[nn.Module, tuple[Tensor, Tensor], Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    batch = (torch.randn(samples, 16), 3 * torch.randn(samples, 8))

    def loss_fn(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, target = batch
        return Float32Binding.apply(model(inputs), target, factor).sum()

    return model, batch, loss_fn


def _applied(factor: float, samples: int = 256) -> Any:
    model, batch, loss_fn = _setup(factor, samples)
    loss_fn(model, batch).backward()
    return check_applied_gradient(model, [batch], loss_fn)


@pytest.mark.parametrize("factor", [0.5, 1.5, 0.02], ids=["half", "x1.5", "98pct-off"])
@pytest.mark.parametrize("samples", [8, 256], ids=["small-loss", "large-loss"])
def test_a_gradient_bug_behind_a_float32_copy_of_the_loss_is_never_ok(factor: float, samples: int) -> None:
    model, batch, loss_fn = _setup(factor, samples)
    recomputed = check_gradients(model, batch, loss_fn)
    assert recomputed.verdict == "fail", str(recomputed)
    applied = _applied(factor, samples)
    assert applied.verdict == "fail", str(applied)
    assert applied.fault == "formula"
    assert not [p for p in applied.probes if p.verdict == "ok"], str(applied)


@pytest.mark.parametrize("samples", [8, 256], ids=["small-loss", "large-loss"])
def test_the_correct_binding_is_ok_in_both_kinds_of_check(samples: int) -> None:
    model, batch, loss_fn = _setup(1.0, samples)
    assert check_gradients(model, batch, loss_fn).verdict == "ok"
    applied = _applied(1.0, samples)
    assert applied.verdict == "ok", str(applied)
    assert applied.noted(NoteCode.APPLIED_COARSE_LOSS)  # measured again at a float32 step, and said so
    assert all(p.verdict == "ok" for p in applied.probes), str(applied)


def test_a_probe_whose_noise_is_comparable_to_its_slope_is_unresolved_not_ok() -> None:
    # the numbers of the report that passed a wrong gradient: analytic 5.16, numeric 3.40 (± 1.4)
    h = 1e-6
    points = (Point(1.0, 100.0 + 3.4 * h, h, 5.16 * h), Point(-1.0, 100.0 - 3.4 * h, -h, -5.16 * h))
    stencil = Stencil(h, 100.0, 5.16, points)
    noisy = Assessment(3.40, 3.40 - 5.16, 1.4, 5.16, "suspect", "unresolved")
    verdict = judge(noisy, stencil, floor=1e-6, multiple=2.0)
    assert (verdict.verdict, verdict.reason) == ("inconclusive", "unresolved")
    precise = Assessment(5.16001, 1e-5, 1e-5, 5.16, "ok", "agrees")
    assert judge(precise, stencil, floor=1e-6, multiple=2.0).verdict == "ok"
    wrong = Assessment(3.40, 3.40 - 5.16, 1e-3, 5.16, "fail", "discrepancy")
    assert judge(wrong, stencil, floor=1e-6, multiple=2.0).verdict == "fail"
