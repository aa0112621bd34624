"""A wrong backward whose effect stays within float32's tolerance: float64 autograd tells it from rounding
(:mod:`gradwatch.engine.recomputed.formula`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradwatch import check_gradients
from gradwatch.engine.results.notes import NoteCode


class Scaled(torch.autograd.Function):
    """The identity whose backward multiplies the gradient by ``factor``; ``float32=True`` rounds it to float32 first,
    as a backward that builds a float32 tensor of its own does even on float64 inputs."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float, float32: bool) -> Tensor:
        ctx.factor, ctx.float32 = factor, float32
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        if ctx.float32:
            grad = grad.float().to(grad.dtype)
        return grad * ctx.factor, None, None


class Branch(nn.Module):
    def __init__(self, factor: float, float32: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.factor, self.float32 = factor, float32

    def forward(self, x: Tensor) -> Tensor:
        return Scaled.apply(torch.tanh(self.linear(x)), self.factor, self.float32)


class Residual(nn.Module):
    """``x + branch(x)`` then a head; the branch's backward is off by ``factor``."""

    def __init__(self, factor: float = 1.0, float32: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(4, 8)
        self.branch = Branch(factor, float32)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        return self.head(h + self.branch(h))


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def test_a_backward_off_by_less_than_the_tolerance_fails_and_is_named() -> None:
    report = check_gradients(Residual(factor=1 + 2e-5), _batch(), _loss)
    assert report.verdict == "fail"
    failing = [p for p in report.probes if p.verdict == "fail" and p.kind in ("descent", "tensor")]
    assert failing
    assert all(p.rel_error < report.rtol for p in failing)  # within the float32 tolerance
    assert report.noted(NoteCode.FORMULA_WRONG_BELOW_TOLERANCE)
    assert report.culprits[:1] == ["branch"]


def test_float32_rounding_inside_a_float64_backward_is_no_fault() -> None:
    report = check_gradients(Residual(float32=True), _batch(), _loss)
    assert report.verdict == "ok"
    assert not report.noted(NoteCode.FORMULA_WRONG_BELOW_TOLERANCE)


def test_a_tolerance_the_user_chose_is_kept() -> None:
    report = check_gradients(Residual(factor=1 + 2e-5), _batch(), _loss, rtol=5e-4)
    assert report.verdict == "ok"


def test_a_float64_model_is_judged_by_its_own_tolerance() -> None:
    model = Residual(factor=1 + 2e-8).double()
    batch = _batch()
    report = check_gradients(model, (batch[0].double(), batch[1]), _loss)
    assert report.verdict == "ok"
    assert not report.noted(NoteCode.FORMULA_WRONG_BELOW_TOLERANCE)


def test_llama_layer_zero_input_norm_dropping_a_term_is_caught() -> None:
    """The RMSNorm backward missing ``d(1/rms)/dx`` at layer 0 changes only the embedding's gradient, through the
    residual stream, by ~1e-5: within float32's tolerance, far beyond its rounding (a healthy model's is ~4e-8)."""
    pytest.importorskip("transformers")
    import culprit_models as cm

    report = check_gradients(cm.llama_with_wrong_norm("model.layers.0.input_layernorm"), cm.tokens(), cm.causal_lm_loss)
    assert report.verdict == "fail"
    assert report.culprits[0] == "model.layers.0.input_layernorm"
    healthy = check_gradients(cm.llama_with_wrong_norm(None), cm.tokens(), cm.causal_lm_loss)
    assert healthy.verdict == "ok"


def test_a_gradient_hook_off_by_less_than_the_tolerance_fails_at_its_module() -> None:
    model = Residual()
    model.head.weight.register_hook(lambda grad: grad * (1 + 1e-4))
    report = check_gradients(model, _batch(), _loss)
    assert report.verdict == "fail"
    assert report.noted(NoteCode.FORMULA_WRONG_BELOW_TOLERANCE)
    assert report.culprits[:1] == ["head"]


def test_a_loss_that_cannot_be_differentiated_in_float64_keeps_its_verdict_with_a_note() -> None:
    def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        if batch[0].dtype == torch.float64 and torch.is_grad_enabled():
            raise RuntimeError("no float64 backward here")
        return _loss(model, batch)

    report = check_gradients(Residual(factor=1 + 2e-5), _batch(), loss)
    assert report.verdict == "ok"
    assert report.noted(NoteCode.FORMULA_UNCHECKED)
