"""An applied check called directly on a loss that draws random numbers (dropout): without the window's random states
it cannot draw training's masks, so it makes no probe (it failed correct gradients before); with them it checks."""

from __future__ import annotations

import torch
from applied_models import MLP, batch_for, cross_entropy

from gradwatch.engine.applied import check_applied_gradient
from gradwatch.engine.function.state import capture_rng
from gradwatch.engine.results.notes import NoteCode


def _trained(dropout: bool) -> tuple[MLP, tuple[torch.Tensor, torch.Tensor], dict]:
    torch.manual_seed(0)
    model = MLP()
    model.train(dropout)
    batch = batch_for(model, size=64, seed=1)
    state = capture_rng()
    model.zero_grad()
    cross_entropy(model, batch).backward()
    return model, batch, state


def test_dropout_without_recorded_random_states_is_not_probed() -> None:
    model, batch, _ = _trained(dropout=True)
    report = check_applied_gradient(model, [batch], cross_entropy)
    assert report.verdict == "inconclusive", str(report)
    assert report.probes == []
    assert "no `rng_states` were given" in " ".join(report.noted(NoteCode.APPLIED_NOT_REPRODUCIBLE))


def test_dropout_with_the_recorded_random_state_is_checked() -> None:
    model, batch, state = _trained(dropout=True)
    report = check_applied_gradient(model, [batch], cross_entropy, rng_states=[state])
    assert report.verdict == "ok", str(report)


def test_a_loss_without_randomness_needs_no_random_states() -> None:
    model, batch, _ = _trained(dropout=False)
    report = check_applied_gradient(model, [batch], cross_entropy)
    assert report.verdict == "ok", str(report)
