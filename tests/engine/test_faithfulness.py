"""Float64 probes that turn out to measure another function than the model's are measured natively, never reported:
an extension that computes in float32 whatever it is given, a branch on the dtype, a backward wrong only in float32."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradwatch import check_gradients
from gradwatch.engine.results.notes import NoteCode


class Float32Extension(torch.autograd.Function):
    """``tanh`` by an "extension" that computes in float32 whatever it is given; its backward is right (``bug=1``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, bug: float) -> Tensor:
        y = torch.from_numpy(np.tanh(x.detach().cpu().numpy().astype(np.float32))).to(x.dtype)
        ctx.save_for_backward(y)
        ctx.bug = bug
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y) * ctx.bug, None


class Float32OnlyBug(torch.autograd.Function):
    """``tanh`` whose backward is 2% off in float32 only, as a kernel specialised by dtype can be."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return torch.tanh(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        derivative = grad * (1 - torch.tanh(x) ** 2)
        return derivative * 1.02 if derivative.dtype == torch.float32 else derivative


class Net(nn.Module):
    def __init__(self, activation: str, bug: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 1)
        self.activation = activation
        self.bug = bug

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if self.activation == "extension":
            h = Float32Extension.apply(h, self.bug)
        elif self.activation == "float32 only bug":
            h = Float32OnlyBug.apply(h)
        else:  # a branch on the dtype: float64 computes 1% more
            h = torch.tanh(h) * (1.01 if h.dtype == torch.float64 else 1.0)
        return self.b(h)


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.mse_loss(model(batch[0]).squeeze(-1), batch[1])


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=generator), torch.randn(16, generator=generator)


def test_a_loss_computed_in_float32_inside_is_probed_natively() -> None:
    report = check_gradients(Net("extension"), _batch(), _loss)
    assert report.verdict == "ok", str(report)
    assert report.count("inconclusive") <= 1, str(report)
    assert report.precision == "native"
    assert report.noted(NoteCode.FLOAT64_UNFAITHFUL), report.notes


def test_a_bug_behind_a_float32_computation_is_caught() -> None:
    report = check_gradients(Net("extension", bug=1.02), _batch(), _loss)
    assert report.verdict == "fail", str(report)
    assert {"a.weight", "a.bias"} & {p.target for p in report.failures}, str(report)


def test_a_backward_wrong_in_float32_only_is_not_taken_for_rounding() -> None:
    report = check_gradients(Net("float32 only bug"), _batch(), _loss)
    assert report.verdict == "fail", str(report)
    assert {"a.weight", "a.bias"} <= {p.target for p in report.failures}, str(report)
    assert report.noted(NoteCode.IMPRECISE_BEYOND_ROUNDING), report.notes


@pytest.mark.parametrize("fail_on_imprecise", [False, True])
def test_a_float64_branch_is_not_a_failure_of_the_native_gradient(fail_on_imprecise: bool) -> None:
    # float64 autograd agrees with float64 finite differences (the float64 function), the native gradient with native
    # ones: the native gradient is right for the native function
    report = check_gradients(Net("branch"), _batch(), _loss, fail_on_imprecise=fail_on_imprecise)
    assert report.verdict == "ok", str(report)
    assert report.noted(NoteCode.FLOAT64_UNFAITHFUL_THERE), report.notes
