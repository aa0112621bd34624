"""TrainingState: what a check disturbs comes back bit for bit."""

from __future__ import annotations

import random

import numpy as np
import torch
from helpers import DropoutBatchNormNet, assert_bit_identical, classification_batch, cross_entropy_loss, snapshot
from torch import nn

from gradwatch.engine.function.state import TrainingState


def test_restore_undoes_rng_buffers_grads_and_modes() -> None:
    torch.manual_seed(0)
    model = DropoutBatchNormNet()
    batch = classification_batch()
    cross_entropy_loss(model, batch).backward()
    before = snapshot(model)
    state = TrainingState.capture(model)
    assert all(p.grad is None for p in model.parameters())  # detached while a check runs

    cross_entropy_loss(model, batch).backward()  # new .grad, BatchNorm statistics move, RNG advances
    random.random()
    np.random.rand()
    model.eval()
    model.net[1].running_mean = torch.zeros(32)  # even a reassigned buffer
    state.restore()
    assert_bit_identical(before, snapshot(model))


def test_replay_gives_the_same_dropout_masks() -> None:
    dropout = nn.Dropout(0.5)
    state = TrainingState.capture(dropout)
    x = torch.ones(1000)
    state.replay_rng()
    first = dropout(x)
    state.replay_rng()
    assert torch.equal(first, dropout(x))
    state.restore()


def test_restore_buffers_after_a_batchnorm_forward() -> None:
    model = nn.BatchNorm1d(4)
    before = {n: b.clone() for n, b in model.named_buffers()}
    state = TrainingState.capture(model)
    model(torch.randn(8, 4))
    assert not torch.equal(model.running_mean, before["running_mean"])
    state.restore_buffers()
    for name, value in model.named_buffers():
        assert torch.equal(value, before[name]), name
    state.restore()


def test_only_the_generators_an_evaluation_drew_from_are_replayed_and_all_are_restored() -> None:
    dropout = nn.Dropout(0.5)
    state = TrainingState.capture(dropout)
    python_before, numpy_before = random.getstate(), np.random.get_state()[1].copy()
    dropout(torch.ones(10))  # draws from torch's generator only
    state.skip_unused_generators()
    random.random()  # after the first evaluation: no longer replayed...
    np.random.rand()
    state.replay_rng()
    assert random.getstate() != python_before
    state.restore()  # ...but restored
    assert random.getstate() == python_before
    assert np.array_equal(np.random.get_state()[1], numpy_before)


def test_numpy_draws_of_the_loss_stay_replayed() -> None:
    state = TrainingState.capture(nn.Linear(2, 2))
    first = np.random.rand()  # the loss draws from NumPy
    state.skip_unused_generators()
    state.replay_rng()
    assert np.random.rand() == first
    state.restore()
