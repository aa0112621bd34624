"""Gradients that are deliberately not the derivative, told by their signature: a straight-through estimator is no
failure, a stop-gradient fails with the tensors named, and both come with the ``ignore=`` pattern that exempts them."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradwatch import check_gradients
from gradwatch.engine.recomputed.signatures import ignore_patterns
from gradwatch.engine.selection import unmatched_patterns


def fake_quantise(weight: Tensor, scale: float = 0.05) -> Tensor:
    """Round to a grid in the forward, the identity in the backward: a straight-through estimator."""
    return weight + (torch.round(weight / scale) * scale - weight).detach()


class QuantisedLinear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, fake_quantise(self.weight), self.bias)


class QuantisedNet(nn.Module):
    def __init__(self, head_bug: float = 1.0, use_quantised: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.quant = QuantisedLinear(16, 16)
        self.head = nn.Linear(16, 1)
        self.head_bug = head_bug
        self.use_quantised = use_quantised

    def forward(self, x: Tensor) -> Tensor:
        h = self.body(x)
        if self.use_quantised:
            h = torch.tanh(self.quant(h))
        else:  # the weight is not used at all, but a hand-written gradient for it is still added below
            h = torch.tanh(h + 0.0 * self.quant.bias) + _PhantomGradient.apply(self.quant.weight)
        out = self.head(h)
        return out if self.head_bug == 1.0 else _ScaleBackward.apply(out, self.head_bug)


class _PhantomGradient(torch.autograd.Function):
    """Zero in the forward, a gradient in the backward: a gradient for a tensor the loss does not depend on (a bug)."""

    @staticmethod
    def forward(ctx, weight: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
        return torch.ones(16, 16) * grad


class _ScaleBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:  # type: ignore[no-untyped-def]
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[no-untyped-def]
        return grad * ctx.factor, None


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.mse_loss(model(batch[0]).squeeze(-1), batch[1])


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=generator), torch.randn(16, generator=generator)


@pytest.mark.parametrize("step", range(3))
def test_a_straight_through_estimator_is_no_failure(step: int) -> None:
    report = check_gradients(QuantisedNet(), _batch(), _loss, step=step, rotation=step)
    assert report.verdict == "ok", str(report)
    surrogate = [p for p in report.probes if p.reason == "surrogate"]
    assert {p.target for p in surrogate} <= {"quant.weight", "*"}, str(report)
    if surrogate:
        assert len(report.surrogates) == 1
        assert "straight-through estimator" in report.surrogates[0]
        assert "ignore=['quant.weight']" in report.surrogates[0]


def test_with_ignore_the_quantised_weight_is_not_probed() -> None:
    report = check_gradients(QuantisedNet(), _batch(), _loss, ignore=["quant.weight"])
    assert report.verdict == "ok", str(report)
    assert report.count("inconclusive") == 0, str(report)
    assert not report.surrogates
    assert all(p.target != "quant.weight" for p in report.probes)


def test_a_bug_next_to_a_straight_through_estimator_is_caught() -> None:
    report = check_gradients(QuantisedNet(head_bug=1.02), _batch(), _loss)
    assert report.verdict == "fail", str(report)


def test_a_gradient_for_a_tensor_the_loss_does_not_use_is_no_estimator() -> None:
    report = check_gradients(QuantisedNet(use_quantised=False), _batch(), _loss)
    assert report.verdict == "fail", str(report)
    assert not any("straight-through" in finding for finding in report.surrogates)


class TargetNetwork(nn.Module):
    """BYOL-style: the target branch is detached by design (its parameters still require grad)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.online = nn.Linear(8, 8)
        self.target = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    def forward(self, x: Tensor) -> Tensor:
        return -F.cosine_similarity(self.online(x), self.target(x).detach()).mean()


def test_a_stop_gradient_fails_with_the_tensors_and_the_pattern_named() -> None:
    report = check_gradients(TargetNetwork(), torch.randn(8, 8), lambda model, x: model(x))
    assert report.verdict == "fail", str(report)
    assert {p.reason for p in report.failures if p.target.startswith("target.")} == {"missing"}
    assert len(report.surrogates) == 1, report.surrogates
    assert "stop-gradient" in report.surrogates[0]
    assert "ignore=['target.*']" in report.surrogates[0]
    assert "ignore=['target.*']" in str(report)
    exempt = check_gradients(TargetNetwork(), torch.randn(8, 8), lambda model, x: model(x), ignore=["target.*"])
    assert not any(p.target.startswith("target.") for p in exempt.probes)


def test_ignore_patterns_cover_whole_modules_where_they_can() -> None:
    names = ["enc.0.weight", "enc.0.bias", "enc.1.weight", "quant.weight", "quant.bias", "head.weight"]
    assert ignore_patterns(["enc.0.weight", "enc.0.bias", "enc.1.weight"], names) == ["enc.*"]
    assert ignore_patterns(["enc.0.weight", "enc.0.bias"], names) == ["enc.0.*"]
    assert ignore_patterns(["quant.weight"], names) == ["quant.weight"]
    assert ignore_patterns(["quant.weight", "head.weight"], names) == ["quant.weight", "head.*"]


def test_a_pattern_that_matches_nothing_warns_with_the_names_it_was_meant_for() -> None:
    names = ["model.encoder.0.weight", "model.encoder.0.bias", "model.head.weight"]
    (message,) = unmatched_patterns(["encoder.*", "model.head.*"], names)
    assert "'encoder.*' matches no parameter" in message
    assert "'model.encoder.*'" in message
    model = nn.Sequential(nn.Linear(3, 3))
    with pytest.warns(UserWarning, match=r"'encoder\.\*' matches no parameter .*they read like '0\.weight'"):
        check_gradients(model, torch.randn(4, 3), lambda m, x: m(x).square().mean(), ignore=["encoder.*"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_gradients(model, torch.randn(4, 3), lambda m, x: m(x).square().mean(), ignore=["0.*"])
