"""The reference of a check: the slice of the batch it is computed on, the reproducibility of the loss, and
non-finite losses and gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DropoutBatchNormNet, classification_batch, cross_entropy_loss
from torch import nn

from gradwatch import check_gradients
from gradwatch.engine.function.evaluation import LossEvaluator, Reference
from gradwatch.engine.function.state import TrainingState
from gradwatch.engine.recomputed.reference import nonfinite_probes, reproduced_center
from gradwatch.engine.results.notes import NoteCode, codes


def test_probes_check_the_loss_of_the_first_samples() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    batch = classification_batch()
    report = check_gradients(model, batch, cross_entropy_loss, probe_batch_size=3)
    assert report.samples == 3
    assert report.verdict == "ok", str(report)
    assert report.loss == pytest.approx(cross_entropy_loss(model, (batch[0][:3], batch[1][:3])).item(), rel=1e-6)
    model[2].weight.register_hook(lambda g: g * 1.01)
    buggy = check_gradients(model, batch, cross_entropy_loss, probe_batch_size=1)
    assert buggy.samples == 1
    assert {p.target for p in buggy.failures if p.kind == "tensor"} == {"2.weight"}, str(buggy)


def test_batchnorm_refusing_one_sample_is_probed_on_four() -> None:
    torch.manual_seed(0)
    report = check_gradients(DropoutBatchNormNet(), classification_batch(), cross_entropy_loss, probe_batch_size=1)
    assert report.samples == 4
    assert report.verdict == "ok", str(report)
    assert report.noted(NoteCode.SLICE_REFUSED), report.notes


def test_loss_refusing_any_slice_is_probed_on_the_whole_batch() -> None:
    def fixed_size_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if batch[0].shape[0] != 32:
            raise ValueError("expects 32 samples")
        return cross_entropy_loss(model, batch)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 4))
    report = check_gradients(model, classification_batch(), fixed_size_loss, probe_batch_size=1)
    assert report.samples == 32
    assert report.verdict == "ok", str(report)
    assert codes(report.notes[-3:]) == [NoteCode.SLICE_REFUSED, NoteCode.SLICE_REFUSED, NoteCode.WHOLE_BATCH]
    assert report.notes[-3:] == [  # the wording users read
        "the loss raised ValueError on the first 1 sample(s) (expects 32 samples)",
        "the loss raised ValueError on the first 4 sample(s) (expects 32 samples)",
        "probes use the whole batch",
    ]


def test_loss_that_cannot_be_reproduced_is_inconclusive_not_failed() -> None:
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    generator = torch.Generator().manual_seed(0)  # a private generator gradwatch cannot replay

    def noisy_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, labels = batch
        noise = torch.randn(inputs.shape, generator=generator)
        return F.cross_entropy(model(inputs + noise), labels)

    report = check_gradients(model, classification_batch(), noisy_loss)
    assert report.verdict == "inconclusive"
    assert report.probes == []
    assert report.noted(NoteCode.NOT_REPRODUCIBLE), report.notes


def test_nonfinite_loss_is_a_failure_of_its_own_kind() -> None:
    def nan_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return cross_entropy_loss(model, batch) * float("nan")

    report = check_gradients(DropoutBatchNormNet(), classification_batch(), nan_loss)
    assert report.verdict == "fail"
    assert [(p.kind, p.target, p.reason) for p in report.probes] == [("loss", "loss", "nonfinite")]


def test_nonfinite_gradient_names_the_tensor() -> None:
    model = nn.Linear(16, 4)

    def sqrt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # d/dw sqrt(w - w) is infinite while the loss itself is finite
        return cross_entropy_loss(model, batch) + (model.bias - model.bias.detach()).abs().sqrt().sum()

    report = check_gradients(model, classification_batch(), sqrt_loss)
    assert report.verdict == "fail"
    assert {p.target for p in report.failures} == {"bias"}
    assert all(p.reason == "nonfinite" for p in report.failures)


def _evaluator(model: nn.Module, loss_fn) -> LossEvaluator:
    params = list(model.named_parameters())
    return LossEvaluator(model, classification_batch(), loss_fn, params, TrainingState.capture(model))


def test_a_loss_that_differs_without_autograd_is_evaluated_with_it() -> None:
    torch.manual_seed(0)
    model = nn.Linear(16, 4)

    def grad_mode_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = cross_entropy_loss(model, batch)
        return loss if torch.is_grad_enabled() else loss + 1.0  # a kernel that differs under torch.no_grad()

    evaluator = _evaluator(model, grad_mode_loss)
    reference = evaluator.reference(with_inputs=False)
    center, jitter = reproduced_center(evaluator, reference, math.nan, torch.float32, torch.float32)
    assert center == pytest.approx(reference.loss, rel=1e-6)
    assert jitter == 0.0  # on a CPU
    assert evaluator.grad_mode
    assert NoteCode.AUTOGRAD_RECORDING in codes(evaluator.notes)


def test_nonfinite_probes_name_the_first_nonfinite_entry_of_a_gradient() -> None:

    grad = torch.zeros(3, 4)
    grad[1, 2] = math.inf
    grad[2, 0] = math.nan
    params = [("w", torch.zeros(3, 4)), ("b", torch.zeros(4))]
    reference = Reference(1.0, [grad, torch.zeros(4)], {})
    probes = nonfinite_probes(reference, params, [math.inf, 0.0])
    assert [(p.kind, p.target, p.index, p.verdict, p.reason) for p in probes] == [
        ("param", "w", (1, 2), "fail", "nonfinite")
    ]
    assert nonfinite_probes(Reference(math.nan, [None, None], {}), params, [0.0, 0.0])[0].kind == "loss"
