"""GradWatchCallback in real (tiny) ``transformers.Trainer`` runs: a randomly initialised Llama, gradient accumulation
2, checks on schedule, training bit for bit as without the callback, and a planted 2% backward bug caught at the first
check with its module named."""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import recomputed_counts

transformers = pytest.importorskip("transformers")

from loop_models import Tokens, assert_same_state, state_of, tiny_llama  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from gradwatch import GradientCheckWarning  # noqa: E402
from gradwatch.cli import main  # noqa: E402
from gradwatch.engine.results.notes import codes  # noqa: E402
from gradwatch.integrations.huggingface import (  # noqa: E402
    STATE_KEY,
    GradWatchCallback,
    run_sinks,
)
from gradwatch.outputs import JsonLinesSink  # noqa: E402

BUGGY = "model.layers.0.self_attn.o_proj"
SHOWN_BUGGY = "model.layers[0].self_attn.o_proj"  # as the culprit message names it
"""The module the bug is planted in: one of the tensors the first check's rotation probes along their gradient."""


def _arguments(tmp_path: Path, steps: int, **arguments: Any) -> Any:
    defaults: dict[str, Any] = {
        "output_dir": str(tmp_path),
        "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 4,
        "max_steps": steps,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "logging_steps": 1,
        "seed": 0,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    return transformers.TrainingArguments(**{**defaults, **arguments})


def _train(
    tmp_path: Path, bug_in: str | None = None, steps: int = 6, arguments: dict[str, Any] | None = None,
    resume: str | None = None, **options: Any,
) -> tuple[Any, GradWatchCallback | None]:  # fmt: skip
    """A tiny Llama trained ``steps`` optimizer steps; with the callback when ``options`` are given (recomputed checks
    on schedule: no budget and no applied check unless the options ask for them)."""
    args = _arguments(tmp_path, steps, **(arguments or {}))
    trainer = transformers.Trainer(model=tiny_llama(bug_in), args=args, train_dataset=Tokens())
    callback = None
    if options:
        callback = GradWatchCallback(trainer, **{"max_overhead": None, "applied_every_n_steps": None, **options})
        trainer.add_callback(callback)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, callback


def _own_entries(trainer: Any) -> list[dict[str, float]]:
    """The Trainer's own log entries of the training steps (loss, gradient norm, learning rate)."""
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.slow
def test_checks_on_schedule_without_false_alarms_and_training_unchanged(tmp_path: Path) -> None:
    without, _ = _train(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        watched, callback = _train(tmp_path, every_n_steps=2)
    assert callback is not None
    assert [(r.step, r.verdict) for r in callback.recomputed_reports] == [(1, "ok"), (2, "ok"), (4, "ok"), (6, "ok")]
    assert callback.counts == {
        "checks": 4,
        "failed": 0,
        "skipped": 0,
        "postponed": 0,
        "applied_checks": 0,
        "applied_failed": 0,
        "update_checks": 0,
        "update_failed": 0,
    }
    assert all(r.samples == 2 for r in callback.recomputed_reports)  # one micro-batch of 4 sequences, probed on 2
    assert_same_state(state_of(without.model, without.optimizer), state_of(watched.model, watched.optimizer))
    assert _own_entries(without) == _own_entries(watched)  # the Trainer's logged values, bit for bit
    # the checks' scalars, one entry of their own at each checked step
    checked = [entry for entry in watched.state.log_history if "gradwatch/verdict" in entry]
    assert [entry["step"] for entry in checked] == [1, 2, 4, 6]
    assert all(entry["gradwatch/verdict"] == 0.0 for entry in checked)
    assert all(entry["gradwatch/rel_error_max_log10"] < -3 for entry in checked)  # the records every loop writes
    # and the JSON lines record beside the logs (no TensorBoard run: output_dir)
    lines = [json.loads(line) for line in (tmp_path / "gradwatch.jsonl").read_text().splitlines()]
    assert [(line["step"], line["verdict"]) for line in lines] == [(1, "ok"), (2, "ok"), (4, "ok"), (6, "ok")]
    assert "compute_loss" not in vars(watched)  # the Trainer's compute_loss is its own again after training


@pytest.mark.slow
def test_the_check_evaluates_the_trainers_own_loss_on_the_kept_micro_batch(tmp_path: Path) -> None:
    seen: list[tuple[int, Any]] = []

    class Counting(transformers.Trainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
            seen.append((self.state.global_step, num_items_in_batch))
            inputs.pop("labels")  # as a label smoother does: the kept micro-batch must not lose its labels
            return super().compute_loss(model, {**inputs, "labels": inputs["input_ids"]}, return_outputs,
                                        num_items_in_batch)  # fmt: skip

    trainer = Counting(model=tiny_llama(), args=_arguments(tmp_path, 2), train_dataset=Tokens())
    callback = GradWatchCallback(
        trainer, every_n_steps=2, first_check_step=None, max_overhead=None, applied_every_n_steps=None
    )
    trainer.add_callback(callback)
    trainer.train()
    assert [r.step for r in callback.recomputed_reports] == [2]
    training = [n for step, n in seen if step == 1][:2]  # the two micro-batches of the second optimizer step
    checking = [n for step, n in seen if step == 2]  # the check's evaluations, at the end of that step
    assert len(checking) >= callback.recomputed_reports[0].n_passes  # vectorised: one call evaluates many points
    # the count of the whole accumulation window, as the Trainer passed it (a number for the check)
    assert {float(n) for n in checking} == {float(training[0])}
    assert callback.recomputed_reports[0].verdict == "ok"


@pytest.mark.slow
def test_a_planted_bug_is_caught_at_the_first_check_with_its_module_and_reported_from_tensorboard(
    tmp_path: Path,
) -> None:
    with pytest.warns(GradientCheckWarning, match=r"failed at step 1: the backward of `model\.layers\[0\]\.self_attn"):
        _trainer, callback = _train(
            tmp_path, bug_in=BUGGY, steps=1, arguments={"report_to": ["tensorboard"]}, every_n_steps=2
        )
    assert callback is not None
    first = callback.recomputed_reports[0]
    assert (first.step, first.verdict) == (1, "fail")
    assert first.culprits[0] == BUGGY
    assert any(p.target == f"{BUGGY}.weight" for p in first.failures)
    # the Trainer's TensorBoard run: its tags, the record beside them, and `gradwatch report` on each
    (run,) = (tmp_path / "runs").iterdir()
    assert (run / "gradwatch.jsonl").is_file()
    tags = EventAccumulator(str(run)).Reload().Tags()
    assert {"train/gradwatch/verdict", "train/gradwatch/rel_error_max_log10"} <= set(tags["scalars"])
    assert "train/gradwatch/rel_error_log10" in tags["histograms"]
    assert _report(tmp_path / "runs") == (1, f"culprit at step 1: the backward of `{SHOWN_BUGGY}`")
    (run / "gradwatch.jsonl").unlink()  # the event files alone: the report reads the record only, and says so
    assert _report(tmp_path / "runs") == (2, "")


def _report(logdir: Path) -> tuple[int, str]:
    """``gradwatch report logdir``: its exit status and its first culprit line."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        code = main(["report", str(logdir)])
    culprits = [line for line in output.getvalue().splitlines() if line.startswith("culprit at step")]
    return code, culprits[0][: len(f"culprit at step 1: the backward of `{SHOWN_BUGGY}`")] if culprits else ""


@pytest.mark.slow
def test_on_fail_stop_ends_training_at_the_failing_step(tmp_path: Path) -> None:
    with pytest.warns(GradientCheckWarning, match="stopping training"):
        trainer, _ = _train(tmp_path, bug_in=BUGGY, every_n_steps=2, on_fail="stop")
    assert trainer.state.global_step == 1


def test_the_trainer_must_be_a_trainer() -> None:
    with pytest.raises(ValueError, match=r"`trainer` must be a transformers\.Trainer; got Module"):
        GradWatchCallback(torch.nn.Module())  # type: ignore[arg-type]


def test_a_cadence_given_by_hand_keeps_the_budget_unless_switched_off(tmp_path: Path) -> None:
    trainer = transformers.Trainer(model=tiny_llama(), args=_arguments(tmp_path, 1), train_dataset=Tokens())
    assert GradWatchCallback(trainer).watch.max_overhead == 0.01
    assert GradWatchCallback(trainer, every_n_steps=10).watch.max_overhead == 0.01
    assert GradWatchCallback(trainer, every_n_steps=10, max_overhead=0.05).watch.max_overhead == 0.05
    assert GradWatchCallback(trainer, every_n_steps=10, max_overhead=None).watch.max_overhead is None


def test_options_are_keyword_only(tmp_path: Path) -> None:
    trainer = transformers.Trainer(model=tiny_llama(), args=_arguments(tmp_path, 1), train_dataset=Tokens())
    with pytest.raises(TypeError):
        GradWatchCallback(trainer, 10)  # type: ignore[misc]


@pytest.mark.slow
def test_resuming_from_a_checkpoint_continues_the_schedule_and_the_counters(tmp_path: Path) -> None:
    saving = {"save_strategy": "steps", "save_steps": 2}
    _, whole = _train(tmp_path, steps=4, arguments=saving, every_n_steps=2)
    assert whole is not None
    assert [r.step for r in whole.reports] == [1, 2, 4]
    saved = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert (saved[STATE_KEY]["checks"], saved[STATE_KEY]["last_step"]) == (2, 2)  # after the check of step 2

    _, resumed = _train(tmp_path, steps=4, arguments=saving, resume=str(tmp_path / "checkpoint-2"), every_n_steps=2)
    assert resumed is not None
    assert [r.step for r in resumed.reports] == [4]  # step 1's first check is not run again
    assert resumed.counts == whole.counts
    assert recomputed_counts(whole.counts) == {"checks": 3, "failed": 0, "skipped": 0, "postponed": 0}
    continued, uninterrupted = resumed.watch.state_dict(), whole.watch.state_dict()
    for key in ("checks", "failed_checks", "last_step", "pending", "postponed_checks", "failure_warnings"):
        assert continued[key] == uninterrupted[key], key
    assert continued["train_seconds"] > saved[STATE_KEY]["train_seconds"]  # the budget's clock went on


def test_the_record_of_a_wandb_or_mlflow_run_goes_beside_its_run_folder(tmp_path: Path) -> None:
    """Where ``gradwatch report`` pointed at their run folders looks (``gradwatch.outputs.beside``); the integrations'
    callbacks stand in as they are once their runs started (wandb and mlflow are not installed here)."""
    from transformers.integrations.integration_utils import MLflowCallback, WandbCallback

    trainer = transformers.Trainer(model=tiny_llama(), args=_arguments(tmp_path, 1), train_dataset=Tokens())
    wandb = object.__new__(WandbCallback)
    wandb._wandb = SimpleNamespace(run=SimpleNamespace(id="abc123de"))
    mlflow = object.__new__(MLflowCallback)
    mlflow._ml_flow = SimpleNamespace(active_run=lambda: SimpleNamespace(info=SimpleNamespace(run_id="f" * 32)))
    mlflow._auto_end_run = False  # what its __del__ reads
    trainer.callback_handler.callbacks += [wandb, mlflow]
    sinks = run_sinks(trainer, trainer.args, trainer.state, print)
    records = [sink.path for sink in sinks if isinstance(sink, JsonLinesSink)]
    assert records == [
        tmp_path / "gradwatch_records" / "WandbCallback-abc123de" / "gradwatch.jsonl",
        tmp_path / "gradwatch_records" / f"MLflowCallback-{'f' * 32}" / "gradwatch.jsonl",
    ]
    trainer.callback_handler.callbacks = trainer.callback_handler.callbacks[:-2]
    assert [sink.path for sink in run_sinks(trainer, trainer.args, trainer.state, print)
            if isinstance(sink, JsonLinesSink)] == [tmp_path / "gradwatch.jsonl"]  # fmt: skip


# --- the applied check: the accumulated gradient the optimizer applies, before the Trainer clips it ------------------

APPLIED = {"applied_every_n_steps": 2, "first_check_step": None, "every_n_steps": 1000}
"""Applied checks at steps 2, 4, ...; no recomputed check in these short runs."""
BF16 = {"bf16": True, "max_grad_norm": 1.0}


class Bf16OnlyWrongLinear(torch.autograd.Function):
    """``x @ weight.T`` whose weight gradient is 30% too large only when its input is bfloat16: a kernel wrong on the
    low-precision path alone."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        if x.dtype == torch.bfloat16:
            grad_weight = grad_weight * 1.3
        return grad @ weight, grad_weight


def _plant_bf16_fault(linear: torch.nn.Linear) -> None:
    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = linear.weight
        if torch.is_autocast_enabled("cpu"):  # what autocast does to a linear layer's operands
            dtype = torch.get_autocast_dtype("cpu")
            x, weight = x.to(dtype), weight.to(dtype)
        return Bf16OnlyWrongLinear.apply(x, weight)

    linear.forward = forward  # type: ignore[method-assign]


def _train_model(tmp_path: Path, model: Any, steps: int, **options: Any) -> tuple[Any, GradWatchCallback | None]:
    trainer = transformers.Trainer(model=model, args=_arguments(tmp_path, steps, **BF16), train_dataset=Tokens())
    callback = None
    if options:
        callback = GradWatchCallback(trainer, **{"max_overhead": None, **options})
        trainer.add_callback(callback)
    trainer.train()
    return trainer, callback


def _is_clipping(report: Any) -> bool:
    """Whether a report is the clip coefficient's check (``watch.after_clipping``), not a check of the gradient."""
    return "applied-clipping" in {str(code) for code in codes(report.notes)}


@pytest.mark.slow
def test_applied_checks_in_a_bf16_trainer_with_accumulation_leave_training_bit_identical(tmp_path: Path) -> None:
    without, _ = _train_model(tmp_path / "without", tiny_llama(), 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        watched, callback = _train_model(tmp_path / "with", tiny_llama(), 4, **APPLIED)
    assert callback is not None
    # each applied check, then the check of the clip coefficient it makes possible (max_grad_norm=1.0)
    clipping = [r for r in callback.reports if _is_clipping(r)]
    checks = [r for r in callback.reports if not _is_clipping(r)]
    # each followed by the update check of the optimizer's step (the Trainer's optimizer hooked, its clip declared)
    assert [(r.scope, r.step, r.verdict) for r in checks] == [
        ("applied", 2, "ok"), ("update", 2, "ok"), ("applied", 4, "ok"), ("update", 4, "ok"),
    ]  # fmt: skip
    assert callback.update_reports == [checks[1], checks[3]]
    assert [(r.scope, r.step, r.verdict) for r in clipping] == [("applied", 2, "ok"), ("applied", 4, "ok")]
    assert callback.counts["applied_failed"] == 0
    assert_same_state(state_of(without.model, without.optimizer), state_of(watched.model, watched.optimizer))
    assert _own_entries(without) == _own_entries(watched)  # the Trainer's logged values, bit for bit
    logged = [entry for entry in watched.state.log_history if "gradwatch/applied/verdict" in entry]
    assert [(entry["step"], entry["gradwatch/applied/verdict"]) for entry in logged] == [(2, 0.0), (4, 0.0)]
    # the clip coefficient's check of the same step under its own tags: neither record stands in place of the other
    clipped = [entry for entry in watched.state.log_history if "gradwatch/applied/clipping/verdict" in entry]
    assert [(entry["step"], entry["gradwatch/applied/clipping/verdict"]) for entry in clipped] == [(2, 0.0), (4, 0.0)]
    assert "clip_grad_norm_" not in vars(watched.accelerator)  # the accelerator's own again after training


@pytest.mark.slow
def test_a_backward_wrong_only_in_bf16_is_a_precision_fault_of_the_applied_gradient(tmp_path: Path) -> None:
    model = tiny_llama()
    _plant_bf16_fault(model.get_submodule(BUGGY))
    with pytest.warns(GradientCheckWarning, match="applied gradient check failed at step 2"):
        _, callback = _train_model(tmp_path, model, 2, **APPLIED)
    assert callback is not None
    (report,) = [r for r in callback.applied_reports if not _is_clipping(r)]
    assert (report.scope, report.step, report.verdict, report.fault) == ("applied", 2, "fail", "precision")
    record = json.loads((tmp_path / "gradwatch.jsonl").read_text().splitlines()[0])  # the check, then the clipping's
    assert (record["scope"], record["fault"]) == ("applied", "precision")


@pytest.mark.slow
def test_a_hook_that_scales_one_accumulated_gradient_is_caught(tmp_path: Path) -> None:
    model = tiny_llama()
    weight = model.get_submodule(BUGGY).weight

    def scale(parameter: torch.Tensor) -> None:  # each time a micro-batch's gradient is accumulated into .grad
        assert parameter.grad is not None
        parameter.grad.mul_(1.2)

    weight.register_post_accumulate_grad_hook(scale)
    with pytest.warns(GradientCheckWarning, match="applied gradient check failed at step 2"):
        _, callback = _train_model(tmp_path, model, 2, **APPLIED)
    assert callback is not None
    (report,) = [r for r in callback.applied_reports if not _is_clipping(r)]
    assert (report.scope, report.verdict) == ("applied", "fail")


@pytest.mark.slow
def test_the_state_a_checkpoint_saves_is_the_watchs_at_its_step_with_no_check_there(tmp_path: Path) -> None:
    # kept when the Trainer saves (step 3, no check there) and at the run's end (step 4), not at every step
    saving = {"save_strategy": "steps", "save_steps": 3}
    trainer, callback = _train(tmp_path, steps=4, arguments=saving, every_n_steps=2)
    assert callback is not None
    assert [r.step for r in callback.reports] == [1, 2, 4]
    saved = json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert (saved[STATE_KEY]["checks"], saved[STATE_KEY]["last_step"]) == (2, 3)
    assert trainer.state.stateful_callbacks[STATE_KEY] == callback.watch.state_dict()
