"""TRL's trainers at their defaults (bf16 autocast, activation checkpointing) under gradient accumulation (issue 44):
the applied check's window loss is the one the Trainer differentiates, so a healthy model passes every check of 20
steps at accumulation 1, 2 and 4. ``SFTTrainer`` divides each micro-batch's summed token loss by the window's count of
labelled tokens (``num_items_in_batch``) and sums them; a ``loss_fn`` of the user's (the model's own loss, a mean over
its micro-batch's tokens, which `docs/trl.md` asks for when ``compute_loss`` has side effects) is weighted by its
micro-batch's share of the window's tokens: summed as it was, two micro-batch means made twice the window's loss and
the first applied check of a healthy model failed (``accumulation``, descent ratio 2.0). The sequences differ in length,
so the micro-batches hold different counts of tokens and equal weights would not do either. ``DPOTrainer`` and
``GRPOTrainer`` at accumulation 1, 2 and 4 the same."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl")

from hf_stack_models import (  # noqa: E402
    VOCAB,
    low_token_reward,
    preference_dataset,
    prompt_dataset,
    tiny_llama,
    tiny_tokenizer,
)

from gradwatch import GradientCheckWarning  # noqa: E402
from gradwatch.integrations.huggingface import GradWatchCallback  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 20
EVERY = 5  # both kinds of check at steps 1, 5, 10, 15 and 20


def _varied_lengths(count: int = 96) -> Any:
    """Token sequences of 4 to 12 tokens: SFT pads each micro-batch, so micro-batches hold unequal token counts."""
    import datasets

    generator = torch.Generator().manual_seed(11)
    lengths = torch.randint(4, 13, (count,), generator=generator).tolist()
    return datasets.Dataset.from_dict(
        {"input_ids": [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]}
    )


def _model_loss(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """The side-effect-free loss a user passes: the model's own loss, the mean over its micro-batch's tokens."""
    return model(**inputs).loss


def _checked(trainer: Any, **options: Any) -> GradWatchCallback:
    callback = GradWatchCallback(
        trainer, max_overhead=None, every_n_steps=EVERY, applied_every_n_steps=EVERY, **options
    )
    trainer.add_callback(callback)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)  # a failing check warns
        trainer.train()
    return callback


def _config(config: type, tmp_path: Path, accumulation: int, **more: Any) -> Any:
    return config(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation, report_to="none", use_cpu=True, save_strategy="no",
        logging_steps=5, seed=0, disable_tqdm=True, **more,
    )  # fmt: skip


def _assert_clean(callback: GradWatchCallback) -> None:
    applied = [(r.step, r.verdict) for r in callback.applied_reports if r.fault is not None or r.verdict == "fail"]
    assert applied == [], [str(r) for r in callback.applied_reports if r.verdict == "fail"]
    assert not [str(r) for r in callback.recomputed_reports if r.verdict == "fail"]
    steps = sorted({r.step for r in callback.applied_reports})
    assert steps == [1, 5, 10, 15, 20]
    assert sum(r.verdict == "ok" for r in callback.applied_reports) >= 5  # concluded, not merely undecided


@pytest.mark.parametrize("accumulation", [1, 2, 4], ids=["acc1", "acc2", "acc4"])
@pytest.mark.parametrize("user_loss", [False, True], ids=["compute_loss", "user_loss_fn"])
def test_sft_at_its_defaults_has_no_failing_check_in_20_steps(
    tmp_path: Path, accumulation: int, user_loss: bool
) -> None:
    args = _config(trl.SFTConfig, tmp_path, accumulation)
    assert args.bf16  # TRL's defaults
    assert args.gradient_checkpointing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainer = trl.SFTTrainer(
            model=tiny_llama(), args=args, train_dataset=_varied_lengths(), processing_class=tiny_tokenizer()
        )
    callback = _checked(trainer, loss_fn=_model_loss if user_loss else None)
    _assert_clean(callback)


def test_sft_with_a_compute_loss_func_under_accumulation_has_no_failing_check(tmp_path: Path) -> None:
    """A ``compute_loss_func`` given the window's count: summed token losses divided by it."""

    def token_sum_over_window(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        logits = outputs.logits[:, :-1].float()
        targets = labels[:, 1:]
        total = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="sum")
        return total / num_items_in_batch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainer = trl.SFTTrainer(
            model=tiny_llama(), args=_config(trl.SFTConfig, tmp_path, 2), train_dataset=_varied_lengths(),
            processing_class=tiny_tokenizer(), compute_loss_func=token_sum_over_window,
        )  # fmt: skip
    _assert_clean(_checked(trainer))


@pytest.mark.parametrize("accumulation", [1, 2, 4], ids=["acc1", "acc2", "acc4"])
def test_dpo_at_its_defaults_has_no_failing_check_in_20_steps(tmp_path: Path, accumulation: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainer = trl.DPOTrainer(
            model=tiny_llama(), ref_model=tiny_llama(), args=_config(trl.DPOConfig, tmp_path, accumulation),
            train_dataset=preference_dataset(count=160), processing_class=tiny_tokenizer(),
        )  # fmt: skip
    _assert_clean(_checked(trainer))


@pytest.mark.parametrize("accumulation", [1, 2, 4], ids=["acc1", "acc2", "acc4"])
def test_grpo_at_its_defaults_has_no_failing_check_in_20_steps(tmp_path: Path, accumulation: int) -> None:
    args = _config(trl.GRPOConfig, tmp_path, accumulation, num_generations=2, max_completion_length=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainer = trl.GRPOTrainer(
            model=tiny_llama(), reward_funcs=low_token_reward, args=args, train_dataset=prompt_dataset(count=160),
            processing_class=tiny_tokenizer(),
        )  # fmt: skip
    _assert_clean(_checked(trainer))
