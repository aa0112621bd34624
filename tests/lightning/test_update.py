"""GradWatch's update checks in real Lightning fits: on by default beside the applied checks (the optimizer's step
hooked from on_before_optimizer_step, inside Lightning's closure), healthy fits clean and bit-identical with and
without them, ``gradient_clip_val`` taken as the declared clip, a wrong optimizer caught at the first update check."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import update_models as models
from helpers import trainer

from gradwatch import GradWatch

pytestmark = pytest.mark.slow


class _Lit(pl.LightningModule):
    def __init__(self, make: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> None:
        super().__init__()
        self.net, self.make = models.mlp(), make

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return models.loss_fn(self.net, batch)

    def configure_optimizers(self) -> Any:
        optimizer = self.make(self.net)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 7, 0.7)}


def _fit(make: Callable[[torch.nn.Module], torch.optim.Optimizer], callbacks: list[pl.Callback], tmp_path: Path,
         steps: int, **options: Any) -> _Lit:  # fmt: skip
    torch.manual_seed(0)
    data = [models.batch() for _ in range(steps)]
    dataset = torch.utils.data.TensorDataset(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]))
    lit = _Lit(make)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32)
    trainer(tmp_path, callbacks, max_steps=steps, **options).fit(lit, loader)
    return lit


def MUON(net: torch.nn.Module) -> torch.optim.Optimizer:  # noqa: N802
    """Muon over the matrices, the biases frozen: Lightning clips the optimizer's parameters, which are then all."""
    for p in net.parameters():
        p.requires_grad_(p.ndim == 2)
    return torch.optim.Muon([p for p in net.parameters() if p.ndim == 2], lr=0.02)


@pytest.mark.parametrize(
    "make", [lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, amsgrad=True), MUON], ids=["adamw", "muon"]
)
def test_a_healthy_fit_is_checked_and_trains_as_without(make: Any, tmp_path: Path) -> None:
    watch = GradWatch(every_n_steps=1000, applied_every_n_steps=10, max_overhead=None, verbose=False)
    watched = _fit(make, [watch], tmp_path, 50, gradient_clip_val=0.05)
    assert [r.step for r in watch.update_reports] == [1, 10, 20, 30, 40, 50]
    assert all(r.verdict == "ok" for r in watch.update_reports), [str(r) for r in watch.update_reports][:1]
    plain = _fit(make, [], tmp_path, 50, gradient_clip_val=0.05)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), watched.parameters(), strict=True))


def test_check_update_false_makes_none(tmp_path: Path) -> None:
    watch = GradWatch(every_n_steps=1000, applied_every_n_steps=2, max_overhead=None, check_update=False)
    _fit(MUON, [watch], tmp_path, 4)
    assert watch.update_reports == []
    assert [r.step for r in watch.applied_reports] == [1, 2, 4]


def test_a_muon_orthogonalising_row_blocks_is_caught_at_the_first_update_check(tmp_path: Path) -> None:
    watch = GradWatch(every_n_steps=1000, applied_every_n_steps=5, max_overhead=None, on_fail=lambda r: None)
    _fit(lambda m: models.RowShardedMuon([p for p in m.parameters() if p.ndim == 2], lr=0.02), [watch], tmp_path, 2)
    report = watch.update_reports[0]
    assert (report.step, report.verdict, report.fault) == (1, "fail", "update")
    assert f"the update of `{report.failures[0].target}`" in report.fault_message
    assert report.failures[0].target.startswith("net.")
