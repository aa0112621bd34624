"""timm's ResNet-18 at initialisation in miniature under Lightning at ``GradWatch()``'s defaults: blocks that end in a
zero-initialised BatchNorm put exact ReLU ties at step 1; no check of either kind fails there (the applied check took
them for a ``formula`` fault before it knew ties, issue 44)."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import trainer
from public_bug_models import ZeroInitResNet, classification_loss, image_batches

from gradwatch import GradWatch


class _Lit(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = ZeroInitResNet()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return classification_loss(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.slow
def test_zero_initialised_residual_batch_norms_fail_no_check_at_step_one(tmp_path: Path) -> None:
    torch.manual_seed(0)
    watch = GradWatch()
    x, y = (torch.cat(parts) for parts in zip(*image_batches(2), strict=True))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    trainer(tmp_path, [watch], max_steps=2).fit(_Lit(), loader)
    first = [r for r in watch.reports if r.step == 1]
    # both kinds of check at step 1, and the update check of the gradient the applied check verified
    assert {r.scope for r in first} == {"applied", "recomputed", "update"}, [r.summary() for r in watch.reports]
    assert all(r.verdict != "fail" for r in watch.reports), "\n".join(str(r) for r in watch.reports)
