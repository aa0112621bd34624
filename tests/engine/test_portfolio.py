"""The portfolio: which probes a check makes, how the tensors take turns, and what a failure or a kink adds."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import classification_batch, cross_entropy_loss
from torch import nn

from gradwatch.engine.function.evaluation import LossEvaluator, Reference
from gradwatch.engine.function.state import TrainingState
from gradwatch.engine.numerics.assessment import Assessment
from gradwatch.engine.numerics.norms import norms
from gradwatch.engine.probing.portfolio import Portfolio, PortfolioTurn
from gradwatch.engine.settings import ProbeSettings


class WithUnusedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
        self.unused = nn.Linear(3, 3)  # receives no gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _portfolio(rotation: int = 0, **settings: int) -> tuple[Portfolio, LossEvaluator, Reference]:
    torch.manual_seed(0)
    model = WithUnusedLayer()
    params = list(model.named_parameters())
    evaluator = LossEvaluator(model, classification_batch(), cross_entropy_loss, params, TrainingState.capture(model))
    reference = evaluator.reference()
    grads = [g if g is not None else p.new_zeros(()) for (_, p), g in zip(params, reference.param_grads, strict=True)]
    options = {"tensor_probes": 2, "random_probes": 1, "param_probes": 3, "input_probes": 2} | settings
    chosen = PortfolioTurn(ProbeSettings(**options), step=0, rotation=rotation, focus=())
    return Portfolio(evaluator, reference, norms(grads, exact=True), chosen, torch.float32), evaluator, reference


def test_the_anchor_is_the_descent_probe_along_the_whole_gradient() -> None:
    portfolio, _, _ = _portfolio()
    anchor = portfolio.anchor()
    assert anchor is not None
    assert (anchor.kind, anchor.target, anchor.index) == ("descent", "*", None)
    assert anchor.direction.analytic == pytest.approx(portfolio.grad_norm, rel=1e-12)


def test_a_check_screens_what_its_settings_ask_for() -> None:
    portfolio, _, _ = _portfolio()
    screens = portfolio.screens(input_direction=True)
    kinds = Counter(task.kind for task in screens)
    # two tensors in turn, one cover probe over the other two; a random direction for each tensor without gradient
    # and one other; three coordinates; the input direction and one input coordinate
    assert kinds == {"tensor": 2, "cover": 1, "random": 2 + 1, "param": 3, "input": 2}
    missing = {task.target for task in screens if task.missing}
    assert missing == {"unused.weight", "unused.bias"}
    assert all(task.kind == "random" for task in screens if task.missing)


def test_every_tensor_with_a_gradient_takes_its_turn() -> None:
    seen = set()
    for rotation in range(2):
        portfolio, _, _ = _portfolio(rotation=rotation)
        seen |= {task.target for task in portfolio.screens(input_direction=False) if task.kind == "tensor"}
    assert seen == {"body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"}


def test_after_a_failure_every_tensor_not_yet_probed_gets_a_tensor_probe() -> None:
    portfolio, _, _ = _portfolio()
    screens = portfolio.screens(input_direction=False)
    extra = portfolio.localization(screens)
    probed = {task.target for task in screens if task.kind == "tensor"}
    assert {task.target for task in extra} == {"body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"} - probed
    assert all(task.kind == "tensor" for task in extra)


def test_a_coordinate_that_crossed_a_kink_is_replaced_in_the_same_tensor() -> None:
    portfolio, _, _ = _portfolio()
    screens = portfolio.screens(input_direction=False)
    kinked = next(task for task in screens if task.kind == "param")
    kinked.result = Assessment(0.0, 0.0, 1.0, 1.0, "inconclusive", "kink")
    (replacement,) = portfolio.replacements(screens)
    assert (replacement.kind, replacement.target) == ("param", kinked.target)
    assert replacement.index is not None


def test_steps_are_relative_to_the_magnitude_moved_in_the_probes_precision() -> None:
    portfolio, _, _ = _portfolio()
    screens = portfolio.screens(input_direction=False)
    tensor = next(task for task in screens if task.kind == "tensor")
    eps = torch.finfo(torch.float32).eps
    assert tensor.step == pytest.approx(eps**0.2 * portfolio._tensor_scale(tensor.tensor), rel=1e-12)
