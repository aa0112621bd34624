"""Cover probes: every tensor with a gradient is in one group at every check, each weighted to contribute equally."""

from __future__ import annotations

import math
import random

import pytest
import torch
from deep_models import deep_llama, language_model_loss, token_batches

from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.function.state import TrainingState
from gradwatch.engine.numerics.norms import norms
from gradwatch.engine.probing.portfolio import Portfolio, PortfolioTurn
from gradwatch.engine.probing.sampling import COVER_SENSITIVITY, MOST_COVER_PROBES, cover_groups, group_size
from gradwatch.engine.settings import ProbeSettings


def test_groups_hold_every_candidate_once_and_balance_their_contributions() -> None:
    norms_ = [10.0 ** -(i % 7) for i in range(150)]
    candidates = list(range(3, 150))
    groups = cover_groups(norms_, candidates, floor=1e-5, rtol=5e-4, rng=random.Random(0))
    assert len(groups) == math.ceil(len(candidates) / group_size(5e-4)) == 2
    assert sorted(i for g in groups for i in g.tensors) == candidates
    for group in groups:
        contributions = [w * norms_[i] ** 2 for i, w in zip(group.tensors, group.weights, strict=True)]
        assert abs(sum(contributions)) <= 1.0  # the signs balance the slope
        # each tensor above the floor contributes ±1; the one below it (1e-6 < 1e-5) in proportion
        assert {round(abs(c), 9) for c in contributions} <= {1.0, 0.1}
        assert group.contributions == pytest.approx(math.hypot(*contributions))


def test_group_size_keeps_the_sensitivity_at_twice_the_tolerance() -> None:
    for rtol in (1e-7, 5e-4, 3e-2):
        size = group_size(rtol)
        assert size == 2 or COVER_SENSITIVITY / math.sqrt(size) >= 2 * rtol
    assert len(cover_groups([1.0] * 5000, range(5000), 1e-3, 5e-4, random.Random(0))) == MOST_COVER_PROBES


def test_a_cover_probe_sees_a_two_percent_error_in_a_tensor_with_a_tiny_share_of_the_gradient() -> None:
    """The slope along a cover probe moves by at least ε/√G of its scale for an error ε in any one of its tensors,
    whatever that tensor's share of ‖g‖ (here the layer-8 MLP down projection of a 12-layer model)."""
    model = deep_llama()
    params = list(model.named_parameters())
    batch = token_batches(1)[0]
    evaluator = LossEvaluator(model, batch, language_model_loss, params, TrainingState.capture(model))
    reference = evaluator.reference()
    grads = [
        g if g is not None else torch.zeros_like(p) for (_, p), g in zip(params, reference.param_grads, strict=True)
    ]
    grad_norms = norms(grads, exact=True)
    settings = PortfolioTurn(ProbeSettings(1, 0, 0, 0), step=0, rotation=0, focus=())
    portfolio = Portfolio(evaluator, reference, grad_norms, settings, torch.float32)
    covers = [task for task in portfolio.screens(input_direction=False) if task.kind == "cover"]
    tensor = next(task.tensor for task in portfolio.screens(input_direction=False) if task.kind == "tensor")
    covered = sorted(i for task in covers for i in task.moves)
    assert covered == [i for i in range(len(params)) if i != tensor]
    down = [name for name, _ in params].index("layers.8.mlp.down_proj.weight")
    assert grad_norms[down] ** 2 < 0.01 * sum(n * n for n in grad_norms)  # a small share of ‖g‖²
    task = next(task for task in covers if down in task.moves)
    direction = task.direction
    wrong = list(direction.grads)
    position = task.moves.index(down)
    wrong[position] = wrong[position] * 1.02
    shifted = type(direction)(direction.tensors, direction.components, wrong, direction.coefficient,
                              weights=direction.weights)  # fmt: skip
    error = abs(shifted.analytic - direction.analytic) / task.scale_floor
    assert error >= 0.02 / math.sqrt(len(task.moves)) * 0.99
    assert error > 4 * 5e-4  # well above float32's tolerance
