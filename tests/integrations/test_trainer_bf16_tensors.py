"""16-bit paths looked at tensor by tensor (issue 44): under the Trainer with ``bf16=True``, a 1.5x fault in one MLP's
gate gradient that exists only under bf16 autocast passed the applied check: the combined probes sum every tensor's
bf16 floor, and the tensor probes made in turn (six per check) did not reach that tensor at the first check. Each
tensor's applied gradient is now held against eager float32 autograd's at its own floor, and a tensor further off is
probed on its own: the fault fails the first applied check (``precision``), while a healthy model's check makes no
more probes than before. A post-accumulate-grad hook that rescales the accumulated gradient is named as what it is
(``modified``, the hook and its parameter), not ``transient``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loop_models import Tokens, tiny_llama  # noqa: E402

from gradwatch.integrations.huggingface import GradWatchCallback  # noqa: E402

pytestmark = pytest.mark.slow

GATE = "model.layers.1.mlp.gate_proj"


class Bf16OnlyWrongLinear(torch.autograd.Function):
    """``x @ weight.T`` whose weight gradient is 1.5 times too large only when its input is bfloat16."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        if x.dtype == torch.bfloat16:
            grad_weight = grad_weight * 1.5
        return grad @ weight, grad_weight


def _plant(linear: torch.nn.Linear) -> None:
    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = linear.weight
        if torch.is_autocast_enabled("cpu"):
            dtype = torch.get_autocast_dtype("cpu")
            x, weight = x.to(dtype), weight.to(dtype)
        return Bf16OnlyWrongLinear.apply(x, weight)

    linear.forward = forward  # type: ignore[method-assign]


def _first_applied(tmp_path: Path, model: Any, accumulation: int = 2) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), gradient_accumulation_steps=accumulation, per_device_train_batch_size=4,
        max_steps=1, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True,
        dataloader_num_workers=0, bf16=True,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    callback = GradWatchCallback(trainer, max_overhead=None, every_n_steps=1000)
    trainer.add_callback(callback)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return callback.applied_reports[0]


def test_a_fault_in_one_tensors_bf16_backward_fails_the_first_applied_check(tmp_path: Path) -> None:
    model = tiny_llama()
    _plant(model.get_submodule(GATE))
    report = _first_applied(tmp_path, model)
    assert (report.step, report.verdict, report.fault) == (1, "fail", "precision"), str(report)
    failing = {p.target for p in report.probes if p.verdict == "fail"}
    assert failing == {f"{GATE}.weight"}, str(report)
    # the whole gradient's probes agree: the gate's share of ‖g‖ is below the bf16 floors they sum
    assert all(p.verdict == "ok" for p in report.probes if p.kind in ("descent", "tensors")), str(report)


def test_a_healthy_bf16_model_makes_no_more_probes(tmp_path: Path) -> None:
    report = _first_applied(tmp_path, tiny_llama())
    assert report.verdict == "ok", str(report)
    # the descent and combined probes and six tensor probes in turn: no tensor is off eager's beyond its floor
    assert len(report.probes) == 8, str(report)


@pytest.mark.parametrize("accumulation", [pytest.param(1, id="acc1"), pytest.param(2, id="acc2")])
def test_a_hook_that_rescales_the_accumulated_gradient_at_the_step_is_named(tmp_path: Path, accumulation: int) -> None:
    model = tiny_llama()
    seen = [0]

    def rescale_at_the_step(parameter: torch.Tensor) -> None:  # on the last micro-batch's accumulation only
        seen[0] += 1
        if seen[0] % accumulation == 0:
            assert parameter.grad is not None
            parameter.grad.mul_(1.5)

    model.get_submodule(GATE).weight.register_post_accumulate_grad_hook(rescale_at_the_step)
    report = _first_applied(tmp_path, model, accumulation)
    assert (report.verdict, report.fault) == ("fail", "modified"), str(report)
    assert f"{GATE}.weight: " in report.fault_message
    assert "rescale_at_the_step" in report.fault_message
