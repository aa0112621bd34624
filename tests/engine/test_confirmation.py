"""Verdicts at the edges: ties at the point, rounding of a correct formula, zero and sparse gradients, bugs that only
exist for more than one sample."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import SeedModel, seed_batch, seed_loss
from torch import Tensor, nn

from gradwatch import check_gradients


class PoolNet(nn.Module):
    """Conv, ReLU, max-pool on images that are exactly zero but for one stroke: every background window is a tie."""

    def __init__(self, input_factor: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 4, 3)
        with torch.no_grad():
            self.conv.bias.fill_(0.1)  # positive: the background's windows tie at a positive value
        self.head = nn.Linear(4 * 5 * 5, 3)
        self.input_factor = input_factor

    def forward(self, x: Tensor) -> Tensor:
        if self.input_factor != 1.0:
            x = ScaleGradient.apply(x, self.input_factor)
        return self.head(F.max_pool2d(F.relu(self.conv(x)), 2).flatten(1))


class ScaleGradient(torch.autograd.Function):
    """The identity, whose backward scales the gradient by ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


def _strokes(samples: int = 4) -> tuple[Tensor, Tensor]:
    images = torch.zeros(samples, 1, 12, 12)
    for i in range(samples):
        images[i, 0, 3 + i, 2:9] = 1.0
    return images, torch.arange(samples) % 3


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def test_ties_at_the_point_are_not_failures() -> None:
    model, batch = PoolNet(), _strokes()
    reports = [check_gradients(model, batch, _loss, step=step, probe_batch_size=2) for step in range(4)]
    assert all(r.verdict != "fail" for r in reports), "\n\n".join(map(str, reports))
    ties = [p for r in reports for p in r.probes if p.reason == "tie"]
    assert ties, "no probe sat on a tie: the test does not exercise the shifted point"
    assert all(p.verdict == "inconclusive" for p in ties)


def test_a_wrong_input_gradient_at_a_tie_still_fails() -> None:
    model, batch = PoolNet(input_factor=1.05), _strokes()
    report = check_gradients(model, batch, _loss, probe_batch_size=2)
    assert report.verdict == "fail", str(report)
    assert any(p.kind == "input" and p.reason == "discrepancy" for p in report.failures)


class LogCumSumExp(nn.Module):
    """``logcumsumexp`` of values near 1e4: its float32 gradient is ~1e-3 off the derivative, a correct formula."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.offset = nn.Parameter(1e4 + torch.randn(256))

    def forward(self, x: Tensor) -> Tensor:
        return torch.logcumsumexp(x + self.offset, dim=-1)


def _weighted(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return (model(batch[0]) * batch[1]).sum()


def _lcse_batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(2, 256, generator=generator), torch.randn(2, 256, generator=generator)


def test_float32_rounding_of_a_correct_formula_is_imprecise_not_failed() -> None:
    model, batch = LogCumSumExp(), _lcse_batch()
    report = check_gradients(model, batch, _weighted, input_probes=0)
    assert report.verdict == "ok", str(report)
    imprecise = [p for p in report.probes if p.reason == "imprecise"]
    assert imprecise, str(report)
    assert all(p.verdict == "ok" and p.rel_error > report.rtol for p in imprecise)
    strict = check_gradients(model, batch, _weighted, input_probes=0, fail_on_imprecise=True)
    assert strict.verdict == "fail"
    assert {p.reason for p in strict.failures} == {"imprecise"}


def test_a_bug_in_a_gradient_hook_is_not_taken_for_rounding() -> None:
    # float64 autograd runs on float64 copies of the parameters, which the hook is not on: it is applied by hand
    model = SeedModel()
    model.fc.weight.register_hook(lambda g: g * 1.002)
    report = check_gradients(model, seed_batch(), seed_loss)
    assert report.verdict == "fail", str(report)
    assert all(p.reason == "discrepancy" for p in report.failures)


class Staircase(nn.Module):
    def __init__(self, detached: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(8, 4)
        self.detached = detached

    def forward(self, x: Tensor) -> Tensor:
        out = self.linear(x)
        return out.detach() + 0.0 * out if self.detached else (10 * out).round()


def test_an_exactly_zero_gradient_is_confirmed_along_random_directions() -> None:
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    report = check_gradients(Staircase(detached=False), batch, lambda m, b: m(b[0]).sum())
    assert report.verdict == "ok", str(report)
    anchor = report.probes[0]
    assert (anchor.kind, anchor.target, anchor.verdict, anchor.analytic) == ("random", "*", "ok", 0.0)


def test_a_zero_gradient_where_the_loss_moves_fails() -> None:
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    report = check_gradients(Staircase(detached=True), batch, lambda m, b: m(b[0]).sum())
    assert report.verdict == "fail", str(report)
    assert {p.reason for p in report.failures} == {"missing"}


class Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.embedding(tokens).mean(1))


@pytest.mark.parametrize("factor", [1.0, 1.1], ids=["correct", "embedding-gradient-x1.1"])
def test_sparse_gradients_are_checked(factor: float) -> None:
    model = Embedded()
    if factor != 1.0:
        model.embedding.weight.register_hook(lambda g: g * factor)
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 50, (4, 6), generator=generator), torch.randint(0, 3, (4,), generator=generator))
    report = check_gradients(model, batch, _loss)
    assert report.verdict == ("ok" if factor == 1.0 else "fail"), str(report)
    if factor != 1.0:
        assert "embedding.weight" in {p.target for p in report.failures}


class CentreFunction(torch.autograd.Function):
    """``x - mean(x)`` per sample; the buggy backward subtracts the mean of the whole batch (right for one sample)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, correct: bool) -> Tensor:
        ctx.correct = correct
        return x - x.mean(-1, keepdim=True)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad - (grad.mean(-1, keepdim=True) if ctx.correct else grad.mean()), None


class Centred(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(CentreFunction.apply(self.first(x), False)))


def test_a_bug_that_needs_two_samples_is_caught_by_the_default_probe_batch() -> None:
    from gradwatch import GradWatch

    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(16, 8, generator=generator), torch.randint(0, 3, (16,), generator=generator))
    one = check_gradients(Centred(), batch, _loss, probe_batch_size=1)
    assert one.verdict == "ok"  # exact for one sample
    default = GradWatch().probe_batch_size
    assert default is not None
    assert default >= 2
    report = check_gradients(Centred(), batch, _loss, probe_batch_size=default)
    assert report.verdict == "fail", str(report)
