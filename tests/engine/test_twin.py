"""The float32 twin a culprit search runs on for a 16-bit model: the model's function on float32 copies, sharing
nothing a check changes; and the applied check of a bfloat16 model with a 3% formula bug naming the module on it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from real_models import ScaledWeightGradient
from torch import Tensor, nn

from gradwatch import check_applied_gradient
from gradwatch.engine.function.twin import float32_twin, is_sixteen_bit, promoted_batch
from gradwatch.engine.results.notes import NoteCode


class Custom(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(12, 16) / 4)
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return ScaledWeightGradient.apply(x, self.weight, self.factor)


class Net(nn.Module):
    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.custom = Custom(factor)
        self.out = nn.Linear(12, 3)
        self.head = self.out  # a shared module

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.custom(self.norm(torch.tanh(self.inp(x))))))


def _loss(model: nn.Module, batch: Any) -> Tensor:
    return F.cross_entropy(model(batch[0]).float(), batch[1])


def _batch(seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=generator).bfloat16(), torch.randint(0, 3, (8,), generator=generator)


def test_the_twin_computes_the_models_function_in_float32_and_shares_nothing_a_check_changes() -> None:
    torch.manual_seed(0)
    model = Net().bfloat16()
    model.norm.register_forward_hook(lambda module, args, output: output)
    twin = float32_twin(model)
    assert is_sixteen_bit(model)
    assert not is_sixteen_bit(twin)
    assert [n for n, _ in twin.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert twin.head is twin.out  # shared modules stay shared
    for (_, mine), (_, theirs) in zip(twin.named_parameters(), model.named_parameters(), strict=True):
        assert mine.dtype == torch.float32
        assert mine is not theirs
        assert torch.equal(mine.bfloat16(), theirs)  # bfloat16 values are exact in float32
    assert len(twin.norm._forward_hooks) == 1
    twin.norm.register_forward_hook(lambda module, args, output: output)
    assert len(model.norm._forward_hooks) == 1  # a hook on the twin stays off the model
    batch = _batch(0)
    promoted = promoted_batch(batch)
    assert promoted[0].dtype == torch.float32
    assert promoted[1] is batch[1]
    assert torch.allclose(_loss(twin, promoted), _loss(model, batch), rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_an_applied_check_names_a_3_percent_formula_bug_of_a_model_in_either_precision(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = Net(factor=1.03).to(dtype)
    batches = [_batch(1), _batch(2)]
    batches = [(x.to(dtype), y) for x, y in batches]
    (sum(_loss(model, b) for b in batches) / 2).backward()  # type: ignore[union-attr]
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    report = check_applied_gradient(model, batches, _loss)
    assert (report.verdict, report.fault) == ("fail", "formula")
    assert report.culprits[0] == "custom"
    assert bool(report.noted(NoteCode.CULPRIT_FLOAT32_TWIN)) == (dtype == torch.bfloat16)
    for param, value, grad in zip(model.parameters(), before, grads, strict=True):
        assert torch.equal(param, value)
        assert torch.equal(param.grad, grad)


def test_a_failing_recomputed_check_of_a_bf16_model_names_the_module_from_its_float32_twin() -> None:
    """A formula bug wrong in every precision: the twin's check fails too, and its culprit is the report's."""
    from gradwatch import check_gradients

    torch.manual_seed(0)
    report = check_gradients(Net(factor=1.05).bfloat16(), _batch(1), _loss)
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == "custom", str(report)
    assert NoteCode.CULPRIT_FLOAT32_TWIN in {note.code for note in report.notes}
