"""Stock layers whose gradient is deliberately not the derivative of their forward are checked as autograd
differentiates them: no false alarm, a note that says so, and bugs around them still caught."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrizations

from gradwatch import check_gradients
from gradwatch.engine.function.surrogates import find_stock_surrogates
from gradwatch.engine.results.notes import NoteCode


class _ScaleBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


class SpectralNet(nn.Module):
    def __init__(self, old_style: bool = False, bug: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        wrap = nn.utils.spectral_norm if old_style else parametrizations.spectral_norm
        self.body = wrap(nn.Linear(8, 16))
        self.head = nn.Linear(16, 1)
        self.bug = bug

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.body(x))
        if self.bug != 1.0:
            h = _ScaleBackward.apply(h, self.bug)
        return self.head(h)


def _regression(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.mse_loss(model(batch[0]).squeeze(-1), batch[1])


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(12, 8, generator=generator), torch.randn(12, generator=generator)


@pytest.mark.parametrize("old_style", [False, True], ids=["parametrizations", "hook"])
def test_spectral_norm_in_training_is_checked_as_autograd_sees_it(old_style: bool) -> None:
    model = SpectralNet(old_style)
    untouched = copy.deepcopy(model)
    report = check_gradients(model, _batch(), _regression)
    assert report.verdict == "ok", str(report)
    assert report.count("inconclusive") == 0, str(report)
    (note,) = report.noted(NoteCode.SPECTRAL_NORM)
    assert "body" in note, report.notes
    assert model.training
    assert model.body.training
    for (name, mine), theirs in zip(model.state_dict().items(), untouched.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name  # the power-iteration vectors included


def test_a_bug_next_to_a_spectral_norm_is_caught() -> None:
    report = check_gradients(SpectralNet(bug=1.02), _batch(), _regression)
    assert report.verdict == "fail", str(report)
    assert any(p.target.startswith("body.") for p in report.failures), str(report)


def test_spectral_norm_in_evaluation_mode_needs_nothing() -> None:
    assert not find_stock_surrogates(SpectralNet().eval()).power_iterations


class EmbeddingNet(nn.Module):
    def __init__(self, bag: bool = False, scale_grad_by_freq: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        if bag:
            self.embed: nn.Module = nn.EmbeddingBag(20, 6, mode="mean", padding_idx=0)
        else:
            self.embed = nn.Embedding(20, 6, padding_idx=0, scale_grad_by_freq=scale_grad_by_freq)
        self.head = nn.Linear(6, 1)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        return self.head(h if h.dim() == 2 else h.mean(1)).squeeze(-1)


def _padded_ids() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 20, (10, 7), generator=generator)
    ids[:, 4:] = 0  # padding
    ids[0, 1] = ids[0, 2] = 5  # repeated tokens
    return ids, torch.randn(10, generator=generator)


@pytest.mark.parametrize("bag", [False, True], ids=["Embedding", "EmbeddingBag"])
def test_the_padding_row_is_not_probed(bag: bool) -> None:
    model = EmbeddingNet(bag)
    for seed in range(4):  # coordinate and random probes land on the padding row with other seeds too
        report = check_gradients(model, _padded_ids(), _regression, seed=seed)
        assert report.verdict == "ok", str(report)
        assert all(p.index is None or p.index[0] != 0 for p in report.probes if p.target == "embed.weight")
    (note,) = report.noted(NoteCode.PADDING_EXEMPT)
    assert "row 0 of embed.weight" in note, report.notes


def test_frequency_scaled_embedding_gradients_are_not_probed() -> None:
    report = check_gradients(EmbeddingNet(scale_grad_by_freq=True), _padded_ids(), _regression)
    assert report.verdict == "ok", str(report)
    assert not any(p.target == "embed.weight" for p in report.probes)
    (note,) = report.noted(NoteCode.NOT_PROBED)
    assert "embed.weight" in note, report.notes
    assert "scale_grad_by_freq" in note, report.notes
