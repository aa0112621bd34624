"""GradWatchCallback on TRL's ``SFTTrainer`` at its defaults (bf16 mixed precision, which Accelerate runs as autocast
around the model's forward; activation checkpointing; its own ``compute_loss``, which records metrics at each call),
on a tiny randomly initialised Llama: checks conclude without false alarm, the run's log history (TRL's metrics
included) is bit for bit the one without gradwatch, and a 3% RMSNorm backward bug is caught at the first check with
that module named. The same for ``DPOTrainer`` at its defaults (the reference model's float32 forward runs inside its
``compute_loss``, beside the check's float64 policy), and for ``GRPOTrainer`` at its defaults (one optimisation pass per
generation: a policy loss whose value is flat, checked on the function autograd differentiates, its detached
log-probabilities held)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl")

from hf_stack_models import (  # noqa: E402
    language_modeling_dataset,
    low_token_reward,
    plant_norm_bug,
    preference_dataset,
    prompt_dataset,
    tiny_llama,
    tiny_tokenizer,
)

from gradwatch import GradientCheckWarning  # noqa: E402
from gradwatch.engine.results.notes import NoteCode  # noqa: E402
from gradwatch.integrations.huggingface import GradWatchCallback  # noqa: E402

pytestmark = pytest.mark.slow

NORM = "model.layers.1.post_attention_layernorm"
SHOWN_NORM = re.escape("model.layers[1].post_attention_layernorm")  # as the culprit message names it
TIMING = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time"}


def _sft(
    tmp_path: Path, steps: int = 6, bug: bool = False, peft_config: Any = None, **options: Any
) -> tuple[Any, GradWatchCallback | None]:
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
    )
    model = tiny_llama()
    if bug:
        plant_norm_bug(model.get_submodule(NORM))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers renames gradient_checkpointing
        trainer = trl.SFTTrainer(
            model=model,
            args=args,
            train_dataset=language_modeling_dataset(),
            processing_class=tiny_tokenizer(),
            peft_config=peft_config,
        )
    callback = None
    if options:
        callback = GradWatchCallback(trainer, **{"max_overhead": None, **options})  # on schedule, no budget
        trainer.add_callback(callback)
    trainer.train()
    return trainer, callback


def _history(trainer: Any) -> list[dict[str, float]]:
    """The run's log history without gradwatch's entries and the timings."""
    return [
        {key: value for key, value in entry.items() if key not in TIMING}
        for entry in trainer.state.log_history
        if not any(key.startswith("gradwatch/") for key in entry)
    ]


def _applied(callback: GradWatchCallback) -> list[tuple[int, str, bool]]:
    """The run's applied checks (step 1 at the defaults): step, verdict, and whether it checked the clip coefficient."""
    return [(r.step, r.verdict, bool(r.noted(NoteCode.APPLIED_CLIPPING))) for r in callback.applied_reports]


def test_sft_at_its_defaults_is_checked_without_false_alarm_and_logs_as_without_gradwatch(tmp_path: Path) -> None:
    without, _ = _sft(tmp_path)
    assert without.args.bf16  # TRL's defaults, on a CPU
    assert without.args.gradient_checkpointing
    assert without.accelerator.native_amp  # the forward runs inside bf16 autocast
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        watched, callback = _sft(tmp_path, every_n_steps=2)
    assert callback is not None
    assert [(r.step, r.verdict) for r in callback.recomputed_reports] == [(1, "ok"), (2, "ok"), (4, "ok"), (6, "ok")]
    # the gradient the optimizer applies, at the first step by default, and the Trainer's clip coefficient after it
    assert _applied(callback) == [(1, "ok", False), (1, "ok", True)]
    assert callback.counts["skipped"] == 0
    # the float32 function outside autocast: far below bf16's rounding (~1e-3 along a gradient)
    assert all(max(r.conclusive_rel_errors) < 1e-4 for r in callback.recomputed_reports)
    history = _history(watched)
    assert history == _history(without)  # bit for bit, TRL's entropy, token accuracy and token count included
    assert all("entropy" in entry and "num_tokens" in entry for entry in history if "loss" in entry)
    checked = [entry for entry in watched.state.log_history if "gradwatch/verdict" in entry]
    assert [entry["step"] for entry in checked] == [1, 2, 4, 6]
    assert not any("entropy" in entry for entry in checked)  # TRL's metrics stay in the Trainer's own entries


def test_a_wrong_rmsnorm_backward_is_caught_at_the_first_check_and_named(tmp_path: Path) -> None:
    named = rf"failed at step 1: the backward of `{SHOWN_NORM}` \(`LlamaRMSNorm`\)"
    with pytest.warns(GradientCheckWarning, match=named):
        _, callback = _sft(tmp_path, steps=1, bug=True, every_n_steps=10)
    assert callback is not None
    first = callback.recomputed_reports[0]
    assert (first.step, first.verdict) == (1, "fail"), str(first)
    assert first.culprits[0] == NORM
    assert "input gradient is" in first.culprit_message


def test_what_compute_loss_records_during_a_check_is_put_back(tmp_path: Path) -> None:
    _, callback = _sft(tmp_path, steps=1, every_n_steps=10)
    assert callback is not None
    trainer = callback.trainer
    recorded = {key: list(values) for key, values in trainer._metrics["train"].items()}
    tokens = trainer._total_train_tokens
    report = callback.watch.check(trainer.model, _one_batch(trainer), callback._trainer_loss(None), step=1)
    assert report is not None
    assert report.n_forward > 10
    assert {key: list(values) for key, values in trainer._metrics["train"].items()} == recorded
    assert trainer._total_train_tokens == tokens


def _one_batch(trainer: Any) -> dict[str, torch.Tensor]:
    batch = next(iter(trainer.get_train_dataloader()))
    return {key: value for key, value in batch.items() if isinstance(value, torch.Tensor)}


def _dpo(tmp_path: Path, steps: int, bug: bool = False, **options: Any) -> tuple[Any, GradWatchCallback | None]:
    args = trl.DPOConfig(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
    )
    model = tiny_llama()
    if bug:
        plant_norm_bug(model.get_submodule(NORM))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainer = trl.DPOTrainer(
            model=model,
            ref_model=tiny_llama(),
            args=args,
            train_dataset=preference_dataset(),
            processing_class=tiny_tokenizer(),
        )
    callback = None
    if options:
        callback = GradWatchCallback(trainer, **{"max_overhead": None, **options})  # on schedule, no budget
        trainer.add_callback(callback)
    trainer.train()
    return trainer, callback


def test_dpo_at_its_defaults_is_checked_in_float64_and_logs_as_without_gradwatch(tmp_path: Path) -> None:
    without, _ = _dpo(tmp_path, steps=4)
    assert without.args.bf16
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        watched, callback = _dpo(tmp_path, steps=4, every_n_steps=2)
    assert callback is not None
    assert [(r.step, r.verdict, r.precision) for r in callback.recomputed_reports] == [
        (1, "ok", "float64"), (2, "ok", "float64"), (4, "ok", "float64")
    ]  # fmt: skip
    assert _applied(callback) == [(1, "ok", False), (1, "ok", True)]
    assert _history(watched) == _history(without)  # DPO's rewards, log-probabilities and token counts included
    assert "rewards/margins" in _history(watched)[0]


def test_a_wrong_rmsnorm_backward_under_dpo_is_caught_at_the_first_check_and_named(tmp_path: Path) -> None:
    with pytest.warns(GradientCheckWarning, match=rf"failed at step 1: the backward of `{SHOWN_NORM}`"):
        _, callback = _dpo(tmp_path, steps=1, bug=True, every_n_steps=10)
    assert callback is not None
    assert callback.recomputed_reports[0].culprits[0] == NORM


def _grpo(tmp_path: Path, steps: int, bug: bool = False, **options: Any) -> tuple[Any, GradWatchCallback | None]:
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,  # short completions: generation is fast on a CPU
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
    )
    model = tiny_llama()
    if bug:
        plant_norm_bug(model.get_submodule(NORM))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=low_token_reward,
            args=args,
            train_dataset=prompt_dataset(),
            processing_class=tiny_tokenizer(),
        )
    callback = None
    if options:
        callback = GradWatchCallback(trainer, **{"max_overhead": None, **options})  # on schedule, no budget
        trainer.add_callback(callback)
    trainer.train()
    return trainer, callback


def test_grpo_at_its_defaults_is_checked_on_the_function_autograd_differentiates(tmp_path: Path) -> None:
    without, _ = _grpo(tmp_path, steps=4)
    args = without.args
    assert (args.bf16, args.gradient_checkpointing, args.num_iterations, args.beta) == (True, True, 1, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        watched, callback = _grpo(tmp_path, steps=4, every_n_steps=1)
    assert callback is not None
    assert [(r.step, r.verdict, r.precision) for r in callback.recomputed_reports] == [
        (s, "ok", "float64") for s in (1, 2, 3, 4)
    ]
    assert _applied(callback) == [(1, "ok", False), (1, "ok", True)]
    assert all(max(r.conclusive_rel_errors) < 1e-5 for r in callback.recomputed_reports)
    assert all(
        r.noted(NoteCode.DETACHED_HELD) for r in callback.recomputed_reports
    )  # logp.detach(): the ratio's denominator
    assert _history(watched) == _history(without)  # rewards, completions, clip ratios, entropy: bit for bit
    assert "rewards/low_token_reward/mean" in _history(watched)[0]


def test_grpo_without_held_values_checks_nothing(tmp_path: Path) -> None:
    _, callback = _grpo(tmp_path, steps=1, every_n_steps=1, hold_detached=False)
    assert callback is not None
    report = callback.recomputed_reports[0]
    assert report.verdict != "fail", str(report)
    assert report.probes[0].reason == "flat", str(report)  # exp(logp - logp.detach()) is 1 at every point


def test_a_wrong_rmsnorm_backward_under_grpo_is_caught_at_the_first_check_and_named(tmp_path: Path) -> None:
    with pytest.warns(GradientCheckWarning, match=rf"failed at step 1: the backward of `{SHOWN_NORM}`"):
        _, callback = _grpo(tmp_path, steps=1, bug=True, every_n_steps=10)
    assert callback is not None
    assert callback.recomputed_reports[0].culprits[0] == NORM
    assert "input gradient is" in callback.recomputed_reports[0].culprit_message


DORA = "base_model.model.model.layers.1.self_attn.q_proj.lora_magnitude_vector.default"


def _dora_config() -> Any:
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, use_dora=True
    )


def test_sft_with_a_dora_adapter_at_its_defaults_is_checked_without_false_alarm(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        trainer, callback = _sft(tmp_path, steps=3, peft_config=_dora_config(), every_n_steps=1)
    assert callback is not None
    assert trainer.args.gradient_checkpointing  # the DoRA modules recomputed inside checkpointed decoder layers
    assert [(r.step, r.verdict, r.precision) for r in callback.recomputed_reports] == [
        (s, "ok", "float64") for s in (1, 2, 3)
    ]
    assert all(r.noted(NoteCode.DORA_NORM) for r in callback.recomputed_reports)


def test_a_wrong_dora_magnitude_gradient_under_sft_fails_the_first_check_and_is_named(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), _dora_config())
    model.get_submodule(DORA).weight.register_hook(lambda grad: grad * 1.03)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradientCheckWarning)
        warnings.simplefilter("ignore", FutureWarning)
        trainer = trl.SFTTrainer(
            model=model,
            args=trl.SFTConfig(
                output_dir=str(tmp_path),
                max_steps=1,
                per_device_train_batch_size=4,
                report_to="none",
                use_cpu=True,
                save_strategy="no",
                seed=0,
                disable_tqdm=True,
            ),
            train_dataset=language_modeling_dataset(),
            processing_class=tiny_tokenizer(),
        )
        callback = GradWatchCallback(trainer, max_overhead=None)
        trainer.add_callback(callback)
        trainer.train()
    report = callback.recomputed_reports[0]
    assert (report.step, report.verdict) == (1, "fail"), str(report)
    assert {p.target for p in report.probes if p.kind == "tensor" and p.verdict == "fail"} == {f"{DORA}.weight"}
    # the culprit search runs through the checkpointed decoder layers, whose DoRA modules feed PEFT's `torch.eye`
    # to the LoRA layers: the search's recomputation replays the forward's leaves
    assert trainer.args.gradient_checkpointing
    assert report.culprits[0] == DORA, str(report)
    assert "(`DoraLinearLayer`) is wrong: the gradient of its parameters is" in report.culprit_message
