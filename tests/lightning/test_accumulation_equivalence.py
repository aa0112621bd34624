"""Accumulation equivalence under Lightning (issue 33): a re-creation of transformers' late-2024 accumulation bug in a
``LightningModule`` (``training_step`` returns the mean over its own micro-batch's labelled tokens, the token counts
differ, ``accumulate_grad_batches=4``) is flagged at the first applied check with the scale; equal-size means, sums and
tuple batches are not. Lightning's window items are ``(batch, batch_idx)``: the callback joins them itself."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import trainer

from gradwatch import GradientCheckWarning, GradWatch
from gradwatch.engine.results.notes import NoteCode
from gradwatch.integrations.lightning.training_step import joined_window

VOCAB, LENGTH, ACCUMULATION = 32, 12, 4
LABELLED = (2, 12, 5, 9)
"""Labelled tokens per sequence in each micro-batch of a window (the rest ``-100``): unequal counts."""


class TokenModule(pl.LightningModule):
    """Embedding, a tanh layer with dropout and an output projection; the loss over the batch's labelled tokens, their
    mean (what transformers' models returned as ``.loss`` before the fix) or their sum."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.hidden = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(16, VOCAB)
        self.reduction = reduction

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self.out(self.drop(torch.tanh(self.hidden(self.embed(batch["input_ids"])))))
        labels = batch["labels"].reshape(-1)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels, ignore_index=-100, reduction=self.reduction)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _token_batches(unequal: bool, windows: int = 2) -> list[dict[str, Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for k in range(ACCUMULATION * windows):
        ids = torch.randint(0, VOCAB, (2, LENGTH), generator=generator)
        labels = ids.roll(-1, dims=1).clone()
        labels[:, LABELLED[k % ACCUMULATION] if unequal else LENGTH :] = -100
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def _fit(module: pl.LightningModule, batches: list[Any], tmp_path: Path) -> GradWatch:
    watch = GradWatch(applied_every_n_steps=100, every_n_steps=1000, max_overhead=None)
    loader = torch.utils.data.DataLoader(batches, batch_size=None)  # each item is a micro-batch already
    trainer(tmp_path, [watch], max_steps=2, accumulate_grad_batches=ACCUMULATION).fit(module, loader)
    return watch


@pytest.mark.slow
def test_per_micro_batch_token_means_of_unequal_counts_are_flagged_at_the_first_applied_check(tmp_path: Path) -> None:
    torch.manual_seed(0)
    with pytest.warns(GradientCheckWarning, match=r"gradwatch \(step 1\): the accumulated gradient is [0-9.]+x"):
        watch = _fit(TokenModule(), _token_batches(unequal=True), tmp_path)
    (report,) = watch.applied_reports
    assert (report.step, report.verdict) == (1, "ok")  # the right derivative of the wrong loss
    assert abs(report.accumulation_scale - 1) > 0.02
    (warning,) = report.noted(NoteCode.ACCUMULATION_UNEQUAL)
    assert f"{report.accumulation_scale:.4g}x" in warning


@pytest.mark.slow
@pytest.mark.parametrize("case", ["equal-size means", "sums"])
def test_equal_size_means_and_sums_are_not_flagged(case: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    sums = case == "sums"
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        watch = _fit(TokenModule("sum" if sums else "mean"), _token_batches(unequal=sums), tmp_path)
    (report,) = watch.applied_reports
    assert report.verdict == "ok"
    assert not report.noted(NoteCode.ACCUMULATION_UNEQUAL), report.notes
    # Lightning divides each micro-batch's loss by accumulate_grad_batches: a sum then averages over the window
    assert report.accumulation_scale == pytest.approx(1 / ACCUMULATION if sums else 1.0, rel=1e-5)


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return (self.net(x).squeeze(1) - y).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.slow
def test_tuple_batches_of_equal_size_are_compared_and_not_flagged(tmp_path: Path) -> None:
    torch.manual_seed(0)
    batches = [(torch.randn(4, 6), torch.randn(4)) for _ in range(2 * ACCUMULATION)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        watch = _fit(_Regression(), batches, tmp_path)
    (report,) = watch.applied_reports
    assert not report.noted(NoteCode.ACCUMULATION_UNEQUAL)
    assert report.accumulation_scale == pytest.approx(1.0, rel=1e-5)
    assert math.isfinite(report.accumulation_cosine)


def test_the_window_items_are_joined_with_the_first_batch_index() -> None:
    items = [((torch.zeros(2, 3), torch.ones(2)), 4), ((torch.ones(1, 3), torch.zeros(1)), 5)]
    (x, y), index = joined_window(items)
    assert (x.shape, y.shape, index) == ((3, 3), (3,), 4)
    assert torch.equal(x[2], torch.ones(3))
