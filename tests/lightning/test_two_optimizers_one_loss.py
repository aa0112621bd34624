"""GradWatch with two optimizers on one loss under Lightning's manual optimization: one ``manual_backward``, then Muon's
step on the matrices and AdamW's on the rest. The second step applies the gradient of the same backward, and is checked
against that loss at the parameters it ran at (before Muon's step): a healthy module is clean for 20 batches and trains
bit for bit as without gradwatch; a step pre-hook scaling one tensor's gradient before AdamW's step is caught, that
tensor named."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import trainer

from gradwatch import GradientCheckWarning, GradWatch

pytestmark = pytest.mark.slow

BATCHES = 20


class OneLoss(pl.LightningModule):
    def __init__(self, fault: float | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        self.fault = fault

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        x, y = batch
        muon, adamw = self.optimizers()  # type: ignore[misc]
        muon.zero_grad()
        adamw.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.net(x), y))
        muon.step()
        adamw.step()

    def configure_optimizers(self) -> Any:
        muon = torch.optim.Muon([p for p in self.net.parameters() if p.ndim == 2], lr=0.02)
        adamw = torch.optim.AdamW([p for p in self.net.parameters() if p.ndim != 2], lr=1e-2)
        if self.fault is not None:
            factor = self.fault

            def scale_last_bias(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                with torch.no_grad():
                    self.net[2].bias.grad.mul_(factor)

            adamw.register_step_pre_hook(scale_last_bias)
        return [muon, adamw]


def _fit(tmp_path: Path, watch: GradWatch | None, fault: float | None = None) -> OneLoss:
    torch.manual_seed(0)
    module = OneLoss(fault)
    data = torch.utils.data.TensorDataset(torch.randn(16 * BATCHES, 6), torch.randn(16 * BATCHES, 3))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    trainer(tmp_path, [watch] if watch is not None else [], max_steps=2 * BATCHES).fit(module, loader)
    return module


def _watch(**options: Any) -> GradWatch:
    return GradWatch(
        applied_every_n_steps=1, every_n_steps=10**6, first_check_step=None, max_overhead=None,
        loss_fn=lambda module, batch: nn.functional.mse_loss(module.net(batch[0]), batch[1]), **options,
    )  # fmt: skip


def test_two_optimizers_on_one_manual_backward_are_clean_for_20_batches(tmp_path: Path) -> None:
    watch = _watch(on_fail="raise")
    checked, plain = _fit(tmp_path, watch), _fit(tmp_path, None)
    reports = watch.applied_reports
    assert len(reports) == 2 * BATCHES  # both optimizers' steps, the second one's too
    assert all(r.verdict == "ok" for r in reports), "\n".join(str(r) for r in reports if r.verdict != "ok")
    assert not [r for r in watch.reports if r.verdict == "fail"]
    updates = watch.update_reports  # each optimizer's update of the gradient its check verified
    assert len(updates) == 2 * BATCHES
    assert all(r.verdict == "ok" for r in updates), "\n".join(str(r) for r in updates if r.verdict != "ok")
    for (name, a), (_, b) in zip(checked.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(checked.trainer.optimizers, plain.trainer.optimizers, strict=True):
        assert str(a.state_dict()) == str(b.state_dict())


def test_a_pre_hook_scaling_one_tensor_before_the_second_step_is_caught(tmp_path: Path) -> None:
    watch = _watch()
    with pytest.warns(GradientCheckWarning, match="applied gradient check failed"):
        _fit(tmp_path, watch, fault=1.5)
    reports = watch.applied_reports
    muon, adamw = reports[0::2], reports[1::2]
    assert len(adamw) == BATCHES
    assert [r.verdict for r in muon] == ["ok"] * BATCHES, "\n".join(str(r) for r in muon if r.verdict != "ok")
    assert [r.verdict for r in adamw] == ["fail"] * BATCHES, "\n".join(str(r) for r in adamw)
    assert [r.fault for r in adamw] == ["modified"] * BATCHES
    failing = {p.target for p in adamw[0].probes if p.verdict == "fail" and p.target != "*"}
    assert failing == {"net.2.bias"}, failing
