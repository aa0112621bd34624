"""GradWatchCallback in real (tiny) ``transformers.Trainer`` runs: a randomly initialised Llama, gradient accumulation
2, checks on schedule, training bit for bit as without the callback, and a planted 2% backward bug caught at the first
check with its module named."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loop_models import Tokens, assert_same_state, state_of, tiny_llama  # noqa: E402

from gradwatch import GradientCheckWarning  # noqa: E402
from gradwatch.integrations.huggingface import GradWatchCallback  # noqa: E402

BUGGY = "model.layers.0.self_attn.o_proj"
"""The module the bug is planted in: one of the tensors the first check's rotation probes along their gradient."""


def _train(
    tmp_path: Path, bug_in: str | None = None, steps: int = 6, **options: Any
) -> tuple[Any, GradWatchCallback | None]:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        max_steps=steps,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=tiny_llama(bug_in), args=args, train_dataset=Tokens())
    callback = None
    if options:
        callback = GradWatchCallback(trainer, **options)
        trainer.add_callback(callback)
    trainer.train()
    return trainer, callback


def _own_entries(trainer: Any) -> list[dict[str, float]]:
    """The Trainer's own log entries of the training steps (loss, gradient norm, learning rate)."""
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_checks_on_schedule_without_false_alarms_and_training_unchanged(tmp_path: Path) -> None:
    without, _ = _train(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        watched, callback = _train(tmp_path, every_n_steps=2)
    assert callback is not None
    assert [(r.step, r.verdict) for r in callback.reports] == [(1, "ok"), (2, "ok"), (4, "ok"), (6, "ok")]
    assert callback.counts == {
        "checks": 4,
        "failed": 0,
        "skipped": 0,
        "postponed": 0,
        "applied_checks": 0,
        "applied_failed": 0,
    }
    assert all(r.samples == 2 for r in callback.reports)  # one micro-batch of 4 sequences, probed on 2
    assert_same_state(state_of(without.model, without.optimizer), state_of(watched.model, watched.optimizer))
    assert _own_entries(without) == _own_entries(watched)  # the Trainer's logged values, bit for bit
    # the checks' scalars, one entry of their own at each checked step
    checked = [entry for entry in watched.state.log_history if "gradwatch/verdict" in entry]
    assert [entry["step"] for entry in checked] == [1, 2, 4, 6]
    assert all(entry["gradwatch/verdict"] == 0.0 for entry in checked)
    assert "compute_loss" not in vars(watched)  # the Trainer's compute_loss is its own again after training


def test_the_check_evaluates_the_trainers_own_loss_on_the_kept_micro_batch(tmp_path: Path) -> None:
    seen: list[tuple[int, Any]] = []

    class Counting(transformers.Trainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
            seen.append((self.state.global_step, num_items_in_batch))
            inputs.pop("labels")  # as a label smoother does: the kept micro-batch must not lose its labels
            return super().compute_loss(model, {**inputs, "labels": inputs["input_ids"]}, return_outputs,
                                        num_items_in_batch)  # fmt: skip

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), gradient_accumulation_steps=2, per_device_train_batch_size=4, max_steps=2,
        report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Counting(model=tiny_llama(), args=args, train_dataset=Tokens())
    callback = GradWatchCallback(trainer, every_n_steps=2, first_check_step=None)
    trainer.add_callback(callback)
    trainer.train()
    assert [r.step for r in callback.reports] == [2]
    training = [n for step, n in seen if step == 1][:2]  # the two micro-batches of the second optimizer step
    checking = [n for step, n in seen if step == 2]  # the check's evaluations, at the end of that step
    assert len(checking) >= callback.reports[0].n_passes  # vectorised: one call evaluates many points
    # the count of the whole accumulation window, as the Trainer passed it (a number for the check)
    assert {float(n) for n in checking} == {float(training[0])}
    assert callback.reports[0].verdict == "ok"


def test_a_planted_bug_is_caught_at_the_first_check_with_its_module(tmp_path: Path) -> None:
    with pytest.warns(GradientCheckWarning, match=r"failed at step 1: the backward of `model\.layers\.0\.self_attn"):
        _, callback = _train(tmp_path, bug_in=BUGGY, steps=2, every_n_steps=2)
    assert callback is not None
    first = callback.reports[0]
    assert (first.step, first.verdict) == (1, "fail")
    assert first.culprits[0] == BUGGY
    assert any(p.target == f"{BUGGY}.weight" for p in first.failures)


def test_on_fail_stop_ends_training_at_the_failing_step(tmp_path: Path) -> None:
    with pytest.warns(GradientCheckWarning, match="stopping training"):
        trainer, _ = _train(tmp_path, bug_in=BUGGY, every_n_steps=2, on_fail="stop")
    assert trainer.state.global_step == 1


def test_the_trainer_must_be_a_trainer() -> None:
    with pytest.raises(ValueError, match=r"`trainer` must be a transformers\.Trainer; got Module"):
        GradWatchCallback(torch.nn.Module())  # type: ignore[arg-type]
