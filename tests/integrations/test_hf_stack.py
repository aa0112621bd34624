"""GradWatchCallback on the ``transformers.Trainer`` set-ups people fine-tune with: activation checkpointing (reentrant
or not) with a planted 3% bug in one MLP activation, a pure-bf16 model (``torch_dtype=bfloat16``, no autocast); and
PEFT LoRA adapters whose backward is wrong, named down to the adapter module; PEFT DoRA adapters, whose weight norm is
detached by design, checked without false alarm and a wrong magnitude gradient named down to its DoRA module."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_stack_models import Tokens, plant_activation_bug, tiny_llama  # noqa: E402

from gradwatch import GradientCheckWarning  # noqa: E402
from gradwatch.engine.results.naming import display_name  # noqa: E402
from gradwatch.integrations.huggingface import GradWatchCallback  # noqa: E402


def _train(tmp_path: Path, model: torch.nn.Module, steps: int, **arguments: Any) -> GradWatchCallback:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=steps,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        **arguments,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    callback = GradWatchCallback(trainer, every_n_steps=1, max_overhead=None)  # on schedule, no budget
    trainer.add_callback(callback)
    trainer.train()
    return callback


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_wrong_activation_under_activation_checkpointing_is_caught_and_named(tmp_path: Path, reentrant: bool) -> None:
    model = tiny_llama()
    buggy = plant_activation_bug(model, layer=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers renames gradient_checkpointing
        warnings.simplefilter("ignore", GradientCheckWarning)
        callback = _train(
            tmp_path,
            model,
            steps=1,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": reentrant},
        )
    counts = callback.counts
    assert (counts["checks"], counts["failed"], counts["skipped"]) == (1, 1, 0)  # no check that could not run
    report = callback.recomputed_reports[0]
    assert (report.step, report.verdict) == (1, "fail")
    assert report.culprits[0] == buggy, str(report)
    assert "(`BuggySiLU`) is wrong: its input gradient is" in report.culprit_message
    # the applied check, by default at the first step, through the same checkpoints (reentrant ones run non-reentrant)
    applied = callback.applied_reports[0]
    assert (applied.step, applied.verdict, applied.fault) == (1, "fail", "formula"), str(applied)
    assert applied.culprits[0] == buggy


@pytest.mark.slow
def test_a_pure_bf16_model_is_checked_without_false_alarm(tmp_path: Path) -> None:
    model = tiny_llama(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        callback = _train(tmp_path, model, steps=8)
    assert [r.verdict for r in callback.recomputed_reports] == ["ok"] * 8
    assert all(r.precision == "float64" for r in callback.recomputed_reports)


@pytest.mark.parametrize(
    ("adapter", "where", "evidence"),
    [("lora_B", "input", "its input gradient is"), ("lora_A", "weight", "the gradient of its parameters is")],
)
def test_a_wrong_lora_adapter_backward_is_named_down_to_the_adapter(adapter: str, where: str, evidence: str) -> None:
    peft = pytest.importorskip("peft")
    from culprit_models import plant_linear_bug
    from hf_stack_models import BUG, token_ids

    from gradwatch import check_gradients

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_llama(), config).train()
    buggy = f"base_model.model.model.layers.1.self_attn.q_proj.{adapter}.default"
    plant_linear_bug(model.get_submodule(buggy), BUG, where)
    ids = torch.tensor(token_ids(4, 12))
    report = check_gradients(model, ids, lambda m, batch: m(input_ids=batch, labels=batch).loss)
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == buggy, str(report)
    assert evidence in report.culprit_message


def _dora_model(seed: int = 0) -> Any:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, use_dora=True
    )
    return peft.get_peft_model(tiny_llama(seed=seed), config).train()


DORA = "base_model.model.model.layers.1.self_attn.q_proj.lora_magnitude_vector.default"


def _language_modeling(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def test_a_healthy_dora_model_is_checked_without_false_alarm() -> None:
    from hf_stack_models import token_ids

    from gradwatch import check_gradients
    from gradwatch.engine.results.notes import NoteCode

    model = _dora_model()
    assert type(model.get_submodule(DORA)).__name__ == "DoraLinearLayer"
    for seed in range(3):
        report = check_gradients(model, torch.tensor(token_ids(4, 12, seed=seed)), _language_modeling, step=seed)
        assert report.verdict == "ok", str(report)
        assert all(p.verdict == "ok" for p in report.probes), str(report)
        assert report.precision == "float64"
        assert max(report.conclusive_rel_errors) < 1e-6
    (note,) = report.noted(NoteCode.DORA_NORM)
    assert "base_model.model.model.layers.1.self_attn.q_proj" in note


def test_a_wrong_dora_magnitude_gradient_is_named_down_to_its_dora_module() -> None:
    from hf_stack_models import BUG, token_ids

    from gradwatch import check_gradients

    model = _dora_model()
    model.get_submodule(DORA).weight.register_hook(lambda grad: grad * BUG)
    report = check_gradients(model, torch.tensor(token_ids(4, 12)), _language_modeling)
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == DORA, str(report)
    assert "(`DoraLinearLayer`) is wrong: the gradient of its parameters is" in report.culprit_message


@pytest.mark.parametrize(
    ("where", "seed", "checkpointing"),
    [
        ("input", 0, None),
        ("input", 1, None),  # once the whole LlamaModel: the sweep spent its budget inside the victim layer 0
        ("input", 0, False),
        ("input", 0, True),
        ("lora_output", 0, None),
        ("lora_output", 0, False),
        ("output", 0, None),
        ("output", 0, True),
    ],
    ids=[
        "input-plain",
        "input-plain-seed1",
        "input-non-reentrant",
        "input-reentrant",
        "lora_output-plain",
        "lora_output-non-reentrant",
        "output-plain",
        "output-reentrant",
    ],
)
def test_a_wrong_gradient_inside_a_dora_forward_is_named_down_to_its_dora_module(
    where: str, seed: int, checkpointing: bool | None
) -> None:
    """A 3% error in a custom Function inside the DoRA module's forward (on its input, between its adapters and its
    result, on its result), the decoder layers checkpointed as ``gradient_checkpointing_enable`` does or not: the
    DoRA module is named, never a module outside it."""
    from hf_stack_models import plant_dora_bug, token_ids

    from gradwatch import check_gradients

    model = _dora_model(seed)
    if checkpointing is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers renames gradient_checkpointing
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
        model.enable_input_require_grads()
    plant_dora_bug(model.get_submodule(DORA), where)
    report = check_gradients(model, torch.tensor(token_ids(4, 12, seed=seed + 3)), _language_modeling)
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == DORA, str(report)
    assert report.culprit_message.startswith(f"the backward of `{display_name(DORA)}` (`DoraLinearLayer`)")


@pytest.mark.parametrize(
    ("fused", "where", "seed", "evidence"),
    [
        (False, "weight", 3, "the gradient of the parameters it reads (`lora_A.default.weight`"),
        (True, "weight", 3, "the gradient of the parameters it reads (`lora_A.default.weight`"),
        (False, "input", 4, "its input gradient is"),
        (True, "input", 6, "its input gradient is"),  # once named the correct input_layernorm feeding it
    ],
    ids=["variant-weight", "fused-weight", "variant-input", "fused-input"],
)
def test_a_custom_lora_variant_reading_its_adapters_weights_is_named(
    fused: bool, where: str, seed: int, evidence: str
) -> None:
    """A LoRA variant whose forward reads ``lora_A[...].weight`` itself, with a 3% error in its hand-written backward:
    the LoRA layer is named (its forward reads the adapter's weights; the ``lora_A`` module never runs), never a
    module outside it (the whole ``LlamaModel`` for a weight gradient, a correct norm for an input gradient)."""
    peft = pytest.importorskip("peft")
    from hf_stack_models import plant_lora_variant_bug, token_ids

    from gradwatch import check_gradients

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_llama(), config).train()
    buggy = "base_model.model.model.layers.1.self_attn.q_proj"
    plant_lora_variant_bug(model, buggy, where, fused)
    ids = torch.tensor(token_ids(4, 12, seed=seed))
    report = check_gradients(model, ids, lambda m, batch: m(input_ids=batch, labels=batch).loss)
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == buggy, str(report)
    assert all(buggy.startswith(f"{name}.") or name == "" for name in report.culprits[1:]), report.culprits
    assert evidence in report.culprit_message, report.culprit_message


@pytest.mark.slow
def test_a_custom_lora_variant_bug_is_caught_and_named_at_the_first_check_of_a_trainer(tmp_path: Path) -> None:
    """The LoRA variant's weight-gradient bug under ``transformers.Trainer`` with ``GradWatchCallback``: the first check
    fails and names the LoRA layer."""
    peft = pytest.importorskip("peft")
    from hf_stack_models import plant_lora_variant_bug

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_llama(), config)
    buggy = "base_model.model.model.layers.1.self_attn.q_proj"
    plant_lora_variant_bug(model, buggy, "weight", fused=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradientCheckWarning)
        callback = _train(tmp_path, model, steps=1)
    report = callback.recomputed_reports[0]
    assert (report.step, report.verdict) == (1, "fail"), str(report)
    assert report.culprits[0] == buggy, str(report)
