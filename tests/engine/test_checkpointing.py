"""Checks of models trained with activation checkpointing (``torch.utils.checkpoint``, reentrant or not) and of
forwards that enter autocast themselves (as Accelerate wraps a model's ``forward`` under mixed precision): float64
probes recompute the checkpointed blocks in float64, a failing check completes its confirmation and culprit search, and
the reference is computed outside autocast wherever the loss enters it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from culprit_models import Tanh
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gradwatch import check_gradients
from gradwatch.engine.function.conditions import autocast_held_off, reentrant_checkpoints_run_non_reentrant


class UpcastBlock(nn.Module):
    """A residual block that normalises in float32 whatever its input's dtype (``x.float()``, as Hugging Face's norms
    do): on float64 storage a probe's recomputation must stay float64, as the forward was."""

    def __init__(self, width: int, factor: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = Tanh(factor)
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x + self.act(self.fc(self.weight * h.to(x.dtype)))


class Checkpointed(nn.Module):
    """Blocks run through ``torch.utils.checkpoint`` in training mode, as ``gradient_checkpointing_enable`` runs
    them; ``bug_at`` plants a 3% input-gradient bug in that block's activation."""

    def __init__(self, reentrant: bool, bug_at: int | None = None, depth: int = 3, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.embed = nn.Linear(6, width)
        self.blocks = nn.ModuleList(UpcastBlock(width, 1.03 if i == bug_at else 1.0) for i in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant) if self.training else block(h)
        return self.head(h)


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(2)
    return torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _autocast_forward(model: nn.Module) -> nn.Module:
    """The model with its ``forward`` wrapped in bf16 autocast, as Accelerate's ``prepare_model`` wraps it."""
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)  # type: ignore[method-assign]
    return model


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast-forward"])
def test_a_checkpointed_model_is_checked_in_float64_without_false_alarm(reentrant: bool, autocast: bool) -> None:
    model = Checkpointed(reentrant).train()
    if autocast:
        _autocast_forward(model)
    report = check_gradients(model, _batch(), _loss)
    assert report.verdict == "ok", str(report)
    assert report.precision == "float64"
    # the float32 function's gradient, with no autocast rounding in it (bf16 rounding would be ~1e-3 along it)
    assert max(report.conclusive_rel_errors) < 1e-4, str(report)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast-forward"])
def test_a_wrong_backward_under_checkpointing_is_confirmed_and_named(reentrant: bool, autocast: bool) -> None:
    model = Checkpointed(reentrant, bug_at=1).train()
    if autocast:
        _autocast_forward(model)
    report = check_gradients(model, _batch(), _loss)
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == "blocks.1.act", str(report)
    assert "input gradient is 3" in report.culprit_message or "input gradient is 2.9" in report.culprit_message


def test_autocast_is_held_off_where_the_code_enters_it_and_restored_after() -> None:
    region = torch.autocast("cpu", dtype=torch.bfloat16)
    x = torch.randn(3, 4)
    with autocast_held_off(), region:
        assert not torch.is_autocast_enabled("cpu")
        assert (x @ x.T).dtype == torch.float32
    assert region._enabled  # the region itself is left as it was made
    with region:
        assert (x @ x.T).dtype == torch.bfloat16


def test_reentrant_checkpoints_compute_the_same_gradient_non_reentrant() -> None:
    model = Checkpointed(reentrant=True).train()
    x = _batch()
    twin = Checkpointed(reentrant=False).train()  # the same parameters (seeded), checkpointed non-reentrant
    expected = torch.autograd.grad(_loss(twin, x), list(twin.parameters()))
    with reentrant_checkpoints_run_non_reentrant():
        # torch.autograd.grad refuses a reentrant checkpoint: it runs here, as a check needs it
        found = torch.autograd.grad(_loss(model, x), list(model.parameters()))
    for a, b in zip(expected, found, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="reentrant"):
        torch.autograd.grad(_loss(model, x), list(model.parameters()))


class ConstantInputBlock(nn.Module):
    """A residual block whose weight is computed by a module fed a constant (``torch.eye``, made inside the block), as
    PEFT's DoRA computes its adapted weight (``lora_B(lora_A(eye))``); ``factor`` plants a 3% input-gradient bug in the
    block's activation."""

    def __init__(self, width: int, factor: float) -> None:
        super().__init__()
        self.adapter = nn.Linear(width, width, bias=False)
        self.act = Tanh(factor)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        weight = self.adapter(torch.eye(x.shape[-1], dtype=x.dtype, device=x.device))
        return self.norm(x + self.act(x @ weight.T))


class ConstantInputs(nn.Module):
    """Three :class:`ConstantInputBlock` run through ``torch.utils.checkpoint`` in training mode."""

    def __init__(self, reentrant: bool, bug_at: int | None = None, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.embed = nn.Linear(6, width)
        self.blocks = nn.ModuleList(ConstantInputBlock(width, 1.03 if i == bug_at else 1.0) for i in range(3))
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant) if self.training else block(h)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("bug_at", [None, 1], ids=["healthy", "bug"])
def test_a_module_fed_a_constant_inside_a_checkpoint_is_searched_and_named(reentrant: bool, bug_at: int | None) -> None:
    # the search's recording makes the constant a function of a zero leaf in the forward: the recomputation must do
    # the same, or torch's checkpoint refuses it ("a different number of tensors was saved")
    report = check_gradients(ConstantInputs(reentrant, bug_at=bug_at).train(), _batch(), _loss)
    if bug_at is None:
        assert report.verdict == "ok", str(report)
        return
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == "blocks.1.act", str(report)
    assert "input gradient is 3" in report.culprit_message or "input gradient is 2.9" in report.culprit_message
