"""Accumulation equivalence under ``transformers.Trainer`` (issue 33): transformers' late-2024 accumulation bug
re-created (a model that does not take the Trainer's ``num_items_in_batch``, so each micro-batch's loss is the mean over
its own labelled tokens and the Trainer averages 4 such means of unequal token counts) is flagged at the first applied
check with the scale; the Trainer's fix (the model divides its summed loss by the window's count) is not, and neither
are equal-size means or a summed ``compute_loss_func``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loop_models import VOCAB, tiny_llama  # noqa: E402

from gradwatch import GradientCheckWarning  # noqa: E402
from gradwatch.engine.results.notes import NoteCode  # noqa: E402
from gradwatch.integrations.huggingface import GradWatchCallback  # noqa: E402
from gradwatch.integrations.trainer_path import joined_inputs  # noqa: E402

ACCUMULATION = 4


class LabelledTokens(torch.utils.data.Dataset):
    """Token sequences of length 12 whose first ``labelled[i]`` positions are labelled (the rest ``-100``): with
    ``unequal`` each micro-batch of 2 has another count of labelled tokens, else all are labelled."""

    def __init__(self, unequal: bool, count: int = 16) -> None:
        self.ids = torch.randint(0, VOCAB, (count, 12), generator=torch.Generator().manual_seed(3))
        self.labelled = [(3, 12, 5, 9)[(i // 2) % ACCUMULATION] if unequal else 12 for i in range(count)]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        labels = self.ids[index].clone()
        labels[self.labelled[index] :] = -100
        return {"input_ids": self.ids[index], "labels": labels}


def _train(
    tmp_path: Path, model: Any, dataset: Any, trainer_class: type = transformers.Trainer, **trainer_options: Any
) -> GradWatchCallback:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), gradient_accumulation_steps=ACCUMULATION, per_device_train_batch_size=2,
        max_steps=1, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = trainer_class(model=model, args=args, train_dataset=dataset, **trainer_options)
    callback = GradWatchCallback(trainer, applied_every_n_steps=100, every_n_steps=1000, max_overhead=None)
    trainer.add_callback(callback)
    trainer.train()
    return callback


def _applied(callback: GradWatchCallback) -> Any:
    # the applied check, not the check of the clip coefficient it makes possible
    (report,) = [r for r in callback.reports if r.scope == "applied" and not r.noted(NoteCode.APPLIED_CLIPPING)]
    return report


def _without_the_fix() -> Any:
    """A model the Trainer does not give ``num_items_in_batch``: its loss is the mean over its micro-batch's tokens."""
    model = tiny_llama()
    model.accepts_loss_kwargs = False
    return model


@pytest.mark.slow
def test_the_late_2024_accumulation_bug_is_flagged_at_the_first_applied_check_with_the_scale(tmp_path: Path) -> None:
    with pytest.warns(GradientCheckWarning, match=r"gradwatch \(step 1\): the accumulated gradient is [0-9.]+x"):
        callback = _train(tmp_path, _without_the_fix(), LabelledTokens(unequal=True))
    report = _applied(callback)
    assert (report.step, report.verdict) == (1, "ok")  # the right derivative of the wrong loss
    assert abs(report.accumulation_scale - 1) > 0.02
    (warning,) = report.noted(NoteCode.ACCUMULATION_UNEQUAL)
    assert f"{report.accumulation_scale:.4g}x" in warning


def _sum_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """The summed token loss (no division): the Trainer then sums the micro-batches' losses."""
    logits = outputs.logits[:, :-1].reshape(-1, VOCAB)
    return torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["the Trainer's fix", "equal-size means", "summed compute_loss_func"])
def test_the_fix_equal_size_means_and_sums_are_not_flagged(case: str, tmp_path: Path) -> None:
    options: dict[str, Any] = {"compute_loss_func": _sum_loss} if case == "summed compute_loss_func" else {}
    model = _without_the_fix() if case == "equal-size means" else tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        callback = _train(tmp_path, model, LabelledTokens(unequal=case != "equal-size means"), **options)
    report = _applied(callback)
    assert report.verdict == "ok"
    assert not report.noted(NoteCode.ACCUMULATION_UNEQUAL), report.notes
    assert report.accumulation_scale == pytest.approx(1.0, rel=1e-5)


def test_the_window_is_joined_with_the_windows_count() -> None:
    first = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "labels": torch.zeros(2, 5, dtype=torch.long)}
    second = {"input_ids": torch.ones(1, 3, dtype=torch.long), "labels": torch.ones(1, 3, dtype=torch.long)}
    inputs, count = joined_inputs([(first, torch.tensor(11)), (second, torch.tensor(11))])
    assert inputs["input_ids"].shape == (3, 5)
    assert int(count) == 11
    assert (inputs["labels"][2, 3:] == -100).all()
    with pytest.raises(ValueError, match="different num_items_in_batch"):
        joined_inputs([(first, torch.tensor(11)), (second, torch.tensor(4))])


def _token_sum(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    logits = model(input_ids=inputs["input_ids"]).logits[:, :-1].reshape(-1, VOCAB)
    labels = inputs["labels"][:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


class NormalisedTwice(transformers.Trainer):
    """A DAPO-style loss: the summed token loss divided by the window's ``num_items_in_batch``, in a trainer that says
    its loss is not scaled for accumulation, so the Trainer divides it by the accumulation steps again: every update 4
    times too small (ms-swift #10117, TRL's 0.25x)."""

    loss_is_scaled_for_ga = False

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        return _token_sum(model, inputs) / num_items_in_batch


class SummedOnly(transformers.Trainer):
    """A summed token loss that ignores ``num_items_in_batch``: the Trainer averages it over the window (consistent)."""

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        return _token_sum(model, inputs)


@pytest.mark.slow
def test_a_loss_normalised_over_the_window_and_divided_again_is_flagged(tmp_path: Path) -> None:
    with pytest.warns(GradientCheckWarning, match="normalised twice"):
        callback = _train(tmp_path, tiny_llama(), LabelledTokens(unequal=True), NormalisedTwice)
    report = _applied(callback)
    assert report.verdict == "ok"  # the right derivative of the wrong loss
    assert report.accumulation_scale == pytest.approx(1 / ACCUMULATION, rel=1e-4)
    (warning,) = report.noted(NoteCode.ACCUMULATION_UNEQUAL)
    assert "4 times too small" in warning


def _token_mean(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """A token mean over the micro-batch alone, given as ``compute_loss_func``: the Trainer takes it for a loss
    normalised over the window and sums the micro-batches' losses."""
    logits = outputs.logits[:, :-1].reshape(-1, VOCAB)
    return torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)


@pytest.mark.slow
def test_micro_batch_means_summed_over_the_window_are_flagged(tmp_path: Path) -> None:
    with pytest.warns(GradientCheckWarning, match="times too large"):
        callback = _train(tmp_path, tiny_llama(), LabelledTokens(unequal=False), compute_loss_func=_token_mean)
    report = _applied(callback)
    assert report.accumulation_scale == pytest.approx(ACCUMULATION, rel=1e-4)


@pytest.mark.slow
def test_a_summed_loss_the_trainer_averages_over_the_window_is_not_flagged(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        callback = _train(tmp_path, _without_the_fix(), LabelledTokens(unequal=True), SummedOnly)
    report = _applied(callback)
    assert not report.noted(NoteCode.ACCUMULATION_UNEQUAL), report.notes
    assert report.accumulation_scale == pytest.approx(1 / ACCUMULATION, rel=1e-4)
