"""Culprits the search attributes rather than observes: parameters a module's forward reads without calling their
module (:mod:`gradwatch.engine.culprits.reads`), and a failing input gradient split between a module's own backward
and the gradient reaching its output (:func:`gradwatch.engine.culprits.activations.own_share`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gradwatch import check_gradients
from gradwatch.engine.culprits.activations import DOWNSTREAM, OWN, own_share
from gradwatch.engine.culprits.reads import direct_reads
from gradwatch.engine.culprits.sites import trace_sites
from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.function.state import TrainingState


class LowRank(torch.autograd.Function):
    """``s (x A^T) B^T`` with a hand-written backward whose ``A`` gradient (``where="weight"``) or input gradient
    (``where="input"``) is ``factor`` off."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, a: Tensor, b: Tensor, factor: float, where: str) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, a, b)
        ctx.factor, ctx.where = factor, where
        return x @ a.T @ b.T

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, a, b = ctx.saved_tensors
        through_b = grad @ b
        grad_x, grad_a, grad_b = through_b @ a, through_b.T @ x, grad.T @ (x @ a.T)
        if ctx.where == "input":
            grad_x = grad_x * ctx.factor
        else:
            grad_a = grad_a * ctx.factor
        return grad_x, grad_a, grad_b, None, None


class Adapted(nn.Module):
    """A linear layer with a low-rank update that reads its adapter's weights itself: ``down`` and ``up`` never run."""

    def __init__(self, width: int, factor: float = 1.0, where: str = "weight") -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.down = nn.Linear(width, 4, bias=False)
        self.up = nn.Linear(4, width, bias=False)
        self.factor, self.where = factor, where

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + LowRank.apply(x, self.down.weight, self.up.weight, self.factor, self.where)


def _adapted_model(factor: float, where: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Adapted(16, factor, where), nn.Tanh(), nn.Linear(16, 4))


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=generator), torch.randint(0, 4, (16,), generator=generator)


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_a_parameter_read_by_an_ancestors_forward_is_attributed_to_it() -> None:
    readers = {"layer.down.weight": {"layer"}, "layer.base.weight": {"layer.base"}, "head.weight": {"head"}}
    assert direct_reads(readers, {"", "layer", "layer.base", "head"}) == {"layer": ["down.weight"]}
    # read by two modules: the innermost module holding both readers and the parameter
    assert direct_reads({"a.w.weight": {"a.x", "a.y"}}, {"", "a", "a.x", "a.y"}) == {"a": ["w.weight"]}
    assert direct_reads({"w.weight": {""}}, {""}) == {"": ["w.weight"]}


def test_the_sites_displace_the_weights_a_module_reads_as_its_own() -> None:
    model = _adapted_model(1.0, "weight")
    evaluator = LossEvaluator(model, _batch(), _loss, list(model.named_parameters()), TrainingState.capture(model))
    sites = trace_sites(model, evaluator)
    assert "2.down" not in sites  # never called
    assert "2.up" not in sites
    assert sites["2"].parameters == ["down.weight", "up.weight"]
    assert sites["2.base"].parameters == ["weight", "bias"]
    reference = torch.autograd.grad(_loss(model, _batch()), [model[2].down.weight, model[2].up.weight])
    recorded = sites["2"].gradients["module_params"]
    for got, expected in zip(recorded, reference, strict=True):
        torch.testing.assert_close(got, expected)


def test_a_wrong_gradient_of_weights_read_directly_names_the_module_reading_them() -> None:
    report = check_gradients(_adapted_model(1.03, "weight"), _batch(), _loss)
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == "2", str(report)  # not the model, not `2.down`, which never runs
    assert "the parameters it reads (`down.weight`, `up.weight`)" in report.culprit_message


def test_a_correct_model_reading_weights_directly_passes() -> None:
    report = check_gradients(_adapted_model(1.0, "weight"), _batch(), _loss)
    assert report.verdict == "ok", str(report)


class ScaledInput(torch.autograd.Function):
    """The identity, whose backward scales the gradient by ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return grad * ctx.factor, None


class Projection(nn.Linear):
    """A linear layer whose input gradient is ``factor`` off."""

    def __init__(self, width: int, factor: float) -> None:
        super().__init__(width, width)
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(ScaledInput.apply(x, self.factor))


class Fanout(nn.Module):
    """A norm feeding three projections, as an attention's input norm feeds its query, key and value projections."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.a, self.b, self.c = Projection(8, factor), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(torch.tanh(self.inner(x)))
        return torch.tanh(self.a(h)) * self.b(h) + self.c(h)


@pytest.mark.parametrize(("module", "expected"), [("a", OWN), ("norm", DOWNSTREAM)], ids=["culprit", "victim"])
def test_a_failing_input_gradient_is_split_between_the_module_and_its_output(module: str, expected: str) -> None:
    """The norm's input gradient is wrong only because the gradient reaching its output is: its backward passes it on
    faithfully. The projection's own backward makes its input gradient wrong."""
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def loss(model: nn.Module, batch: Tensor) -> Tensor:
        return model(batch).square().sum()

    correct, buggy = Fanout(1.0).double(), Fanout(1.03).double()
    truth = trace_sites(correct, LossEvaluator(correct, x, loss, list(correct.named_parameters()), _state(correct)))
    evaluator = LossEvaluator(buggy, x, loss, list(buggy.named_parameters()), _state(buggy))
    site = trace_sites(buggy, evaluator)[module]
    grads = site.gradients["module_input"]
    size = torch.cat([g.flatten() for g in grads]).norm()
    components = [g / size for g in grads]
    analytic = sum(float((g * c).sum()) for g, c in zip(grads, components, strict=True))
    true_grads = truth[module].gradients["module_input"]
    numeric = sum(float((g * c).sum()) for g, c in zip(true_grads, components, strict=True))
    assert abs(analytic - numeric) > 1e-4 * abs(numeric)  # the input probe fails
    assert own_share(site, components, analytic, numeric, 1e-4, evaluator.loss) == expected


def _state(model: nn.Module) -> TrainingState:
    return TrainingState.capture(model)
