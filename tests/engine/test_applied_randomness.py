"""An applied check called directly on a loss that draws random numbers (dropout): without the window's random states
it cannot draw training's masks, so it makes no probe (it failed correct gradients before); with them it checks."""

from __future__ import annotations

import numpy as np
import pytest
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


def _numpy_noise_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A loss whose noise comes from NumPy's global generator (an augmentation inside the loss)."""
    noise = torch.from_numpy(np.random.standard_normal(batch[0].shape)).to(batch[0].dtype)
    return cross_entropy(model, (batch[0] + 0.1 * noise, batch[1]))


def test_numpy_noise_in_the_loss_is_replayed_at_every_evaluation() -> None:
    torch.manual_seed(0)
    model = MLP().train(False)
    batch = batch_for(model, size=64, seed=1)
    np.random.seed(0)
    state = capture_rng()
    _numpy_noise_loss(model, batch).backward()
    report = check_applied_gradient(model, [batch], _numpy_noise_loss, rng_states=[state])
    assert report.verdict == "ok", str(report)
    assert report.n_forward == 5, str(report)  # the screens agree: every evaluation drew training's noise


def test_numpy_is_set_again_only_while_the_loss_may_draw_from_it(monkeypatch: pytest.MonkeyPatch) -> None:
    set_states: list[object] = []
    original = np.random.set_state
    monkeypatch.setattr(np.random, "set_state", lambda value: set_states.append(value) or original(value))
    model, batch, state = _trained(dropout=True)
    set_states.clear()
    report = check_applied_gradient(model, [batch], cross_entropy, rng_states=[state])
    assert report.verdict == "ok", str(report)
    # the window's first evaluation and the restore of the check's own state; not one per evaluation
    assert len(set_states) < report.n_forward, len(set_states)
