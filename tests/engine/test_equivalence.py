"""Accumulation equivalence (issue 33): the accumulated gradient against the window's samples taken as one batch.

The done-when case is a re-creation of transformers' late-2024 gradient-accumulation bug in a plain loop: each
micro-batch's loss is the mean over its own tokens, the token counts differ, and the loop averages 4 such means. Its
gradient is the right derivative of that loss (the applied check passes) but not the gradient of the window's tokens:
flagged at the first applied check with the scale. Equal-size means and sums: nothing flagged.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradwatch.engine.applied import AppliedWindow
from gradwatch.engine.applied.equivalence import concatenate
from gradwatch.engine.results.notes import NoteCode

VOCAB, LENGTH, ACCUMULATION = 32, 12, 4


class TinyLM(nn.Module):
    """Embedding, a tanh layer with dropout, and an output projection: next-token logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.hidden = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(16, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.drop(torch.tanh(self.hidden(self.embed(ids)))))


def token_mean(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The mean over this micro-batch's own labelled tokens (what transformers' models returned as ``.loss``)."""
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100)


def token_sum(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100, reduction="sum")


def micro_batches(unequal: bool, seed: int = 0, lengths: tuple[int, ...] | None = None) -> list[dict[str, Tensor]]:
    """4 micro-batches of 2 sequences; with ``unequal`` each has another count of labelled tokens (the rest -100)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for k in range(ACCUMULATION):
        length = lengths[k] if lengths else LENGTH
        ids = torch.randint(0, VOCAB, (2, length), generator=generator)
        labels = ids.roll(-1, dims=1).clone()
        labelled = [2, 12, 5, 9][k] if unequal else length
        labels[:, labelled:] = -100
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def accumulate(model: nn.Module, batches: list[Any], loss_fn: Any, divide: bool) -> AppliedWindow:
    """A plain loop's window: each micro-batch's loss (divided by the accumulation when ``divide``) backward."""
    model.zero_grad(set_to_none=True)
    window = AppliedWindow(model)
    for batch in batches:
        window.record(batch)
        loss = loss_fn(model, batch)
        (loss / len(batches) if divide else loss).backward()
    return window


def test_per_micro_batch_token_means_of_unequal_counts_are_flagged_at_the_first_check_with_the_scale() -> None:
    torch.manual_seed(0)
    model = TinyLM().train()
    report = accumulate(model, micro_batches(unequal=True), token_mean, divide=True).check(token_mean)
    assert report.verdict == "ok"  # the gradient is the derivative of the loop's loss...
    warning = report.noted(NoteCode.ACCUMULATION_UNEQUAL)  # ...of the wrong loss
    assert len(warning) == 1
    assert abs(report.accumulation_scale - 1) > 0.02
    assert f"{report.accumulation_scale:.4g}x" in warning[0]
    assert report.accumulation_cosine < 1
    figures = report.noted(NoteCode.ACCUMULATION_EQUIVALENCE)[0]
    assert f"scale {report.accumulation_scale:.6g}" in figures
    assert "their measured rounding" in figures  # beyond the least tolerance: the rounding was measured


@pytest.mark.parametrize("case", ["equal-size means", "sums summed", "sums averaged"])
def test_equal_size_means_and_sums_are_not_flagged(case: str) -> None:
    torch.manual_seed(0)
    model = TinyLM().train()
    if case == "equal-size means":
        window = accumulate(model, micro_batches(unequal=False), token_mean, divide=True)
        report = window.check(token_mean)
    else:  # a sum over tokens, micro-batches of unequal counts: summed, or averaged over the window (also consistent)
        averaged = case == "sums averaged"
        window = accumulate(model, micro_batches(unequal=True), token_sum, divide=averaged)
        report = window.check(token_sum, combine="mean" if averaged else "sum")
    assert report.verdict == "ok"
    assert not report.noted(NoteCode.ACCUMULATION_UNEQUAL), report.notes
    # within the least tolerance: the third backward pass, which measures the rounding, is not made
    assert "units of torch.float32's epsilon" in report.noted(NoteCode.ACCUMULATION_EQUIVALENCE)[0]
    expected = 1 / ACCUMULATION if case == "sums averaged" else 1.0
    assert report.accumulation_scale == pytest.approx(expected, rel=1e-5)
    assert report.accumulation_cosine == pytest.approx(1.0, abs=1e-6)


def test_micro_batches_of_different_lengths_are_padded() -> None:
    batches = micro_batches(unequal=True, lengths=(12, 7, 9, 12))
    joined = concatenate(batches)
    assert joined["input_ids"].shape == (8, 12)
    assert (joined["labels"][2:4, 7:] == -100).all()
    assert (joined["input_ids"][2:4, 7:] == 0).all()
    torch.manual_seed(0)
    model = TinyLM().train()
    report = accumulate(model, batches, token_mean, divide=True).check(token_mean)
    assert report.noted(NoteCode.ACCUMULATION_UNEQUAL)
    assert math.isfinite(report.accumulation_scale)


def test_batches_that_cannot_be_concatenated_are_said_and_not_compared() -> None:
    with pytest.raises(ValueError, match="padding"):
        concatenate([(torch.zeros(2, 3), torch.zeros(2)), (torch.zeros(2, 4), torch.zeros(2))])
    torch.manual_seed(0)
    model = nn.Linear(3, 1)

    def loss_fn(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        return (model(batch[0][:, :3]).squeeze(1) - batch[1]).square().mean()

    batches = [(torch.randn(2, 3), torch.randn(2)), (torch.randn(2, 4), torch.randn(2))]
    report = accumulate(model, batches, loss_fn, divide=True).check(loss_fn)
    assert report.verdict == "ok"
    assert math.isnan(report.accumulation_scale)
    assert "not compared" in report.noted(NoteCode.ACCUMULATION_EQUIVALENCE)[0]


def test_one_micro_batch_is_not_compared_and_the_model_is_left_in_training_mode() -> None:
    torch.manual_seed(0)
    model = TinyLM().train()
    report = accumulate(model, micro_batches(unequal=True)[:1], token_mean, divide=False).check(token_mean)
    assert math.isnan(report.accumulation_scale)
    assert not report.noted(NoteCode.ACCUMULATION_EQUIVALENCE)
    report = accumulate(model, micro_batches(unequal=True), token_mean, divide=True).check(token_mean)
    assert all(module.training for module in model.modules())


def test_a_loss_drawing_random_numbers_is_not_compared() -> None:
    torch.manual_seed(0)
    model = TinyLM().train()

    def noisy(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:  # a VAE-like draw, in eval mode too
        return token_mean(model, batch) + 1e-3 * torch.randn(()) * model.out.bias.sum()

    report = accumulate(model, micro_batches(unequal=False), noisy, divide=True).check(noisy)
    assert not report.noted(NoteCode.ACCUMULATION_UNEQUAL)
    assert "random" in report.noted(NoteCode.ACCUMULATION_EQUIVALENCE)[0]


def test_micro_batch_means_summed_over_the_window_are_flagged_as_too_large() -> None:
    """A loop that never divides its micro-batch means by the accumulation steps (TRL's "4x" class): its update is the
    one-batch gradient times the window's size, said whatever ``combine`` the loop declares."""
    torch.manual_seed(0)
    model = TinyLM().train()
    window = accumulate(model, micro_batches(unequal=False), token_mean, divide=False)
    report = window.check(token_mean, combine="sum")
    assert report.verdict == "ok"  # the right derivative of the loss the loop computes
    assert report.accumulation_scale == pytest.approx(ACCUMULATION, rel=1e-5)
    (warning,) = report.noted(NoteCode.ACCUMULATION_UNEQUAL)
    assert f"{ACCUMULATION} times too large" in warning


def _window_normalised(model: nn.Module, batch: dict[str, Tensor], count: int) -> Tensor:
    return token_sum(model, batch) / count


@pytest.mark.parametrize("said", [True, "asked"])
def test_a_loss_normalised_over_the_window_and_divided_again_is_flagged_when_the_loop_says_so(said: Any) -> None:
    """Each micro-batch's summed loss divided by the window's token count (a DAPO-style loss), then by the number of
    micro-batches again: the one-batch gradient divided by the window's size, as a summed loss averaged would be; the
    loop that says its losses are normalised over the window gets the warning (a function is asked only then)."""
    torch.manual_seed(0)
    model = TinyLM().train()
    batches = micro_batches(unequal=True)
    count = sum(int((b["labels"] != -100).sum()) for b in batches)
    loss = lambda m, b: _window_normalised(m, b, count)  # noqa: E731
    window = accumulate(model, batches, loss, divide=True)
    asked: list[bool] = []
    normalised = True if said is True else lambda: asked.append(True) or True
    report = window.check(loss, window_normalised=normalised)
    assert report.accumulation_scale == pytest.approx(1 / ACCUMULATION, rel=1e-5)
    (warning,) = report.noted(NoteCode.ACCUMULATION_UNEQUAL)
    assert "normalised twice" in warning
    assert f"{ACCUMULATION} times too small" in warning
    assert asked == ([] if said is True else [True])
    assert not window.check(loss).noted(NoteCode.ACCUMULATION_UNEQUAL)  # unsaid: a summed loss averaged


def test_the_loop_is_not_asked_when_the_window_agrees() -> None:
    torch.manual_seed(0)
    model = TinyLM().train()
    window = accumulate(model, micro_batches(unequal=False), token_mean, divide=True)
    report = window.check(token_mean, window_normalised=lambda: pytest.fail("asked"))
    assert not report.noted(NoteCode.ACCUMULATION_UNEQUAL)
