"""A ``training_step`` that changes the model itself (in place, hooks, the optimizer's learning rate) or refuses
displaced inputs trains exactly as it would without GradWatch; a checkpoint whose focus names a parameter the module no
longer has resumes with every check made."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import trainer
from lightning_patterns import Classifier, Pattern, compare, fit
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from gradwatch import GradientCheckWarning, GradWatch

pytestmark = pytest.mark.slow


class InPlaceProjection(Classifier):
    """A projection step in ``training_step``: the first layer's weights clamped in place before the forward."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        with torch.no_grad():
            self.net[0].weight.clamp_(-0.2, 0.2)
        return super().training_step(batch, batch_idx)


class HookEveryStep(Classifier):
    """A forward hook registered at every step (never removed) and the learning rate decayed by hand."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.net[3].register_forward_hook(lambda module, args, out: out * 1.01)
        optimizer = self.optimizers()
        assert not isinstance(optimizer, list)
        optimizer.param_groups[0]["lr"] *= 0.9  # type: ignore[union-attr]
        return super().training_step(batch, batch_idx)

    def observe(self) -> dict[str, Any]:
        return {"hooks": len(self.net[3]._forward_hooks)}


class Reconstruction(pl.LightningModule):
    """An autoencoder on binarised pixels: ``binary_cross_entropy(recon, x)`` needs x in [0, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = nn.Linear(16, 4), nn.Linear(4, 16)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (x,) = batch
        loss = F.binary_cross_entropy(torch.sigmoid(self.decoder(torch.tanh(self.encoder(x)))), x)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def observe(self) -> dict[str, Any]:
        return {}


def pixel_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(7)
    return DataLoader(TensorDataset((torch.rand(96, 16, generator=generator) > 0.5).float()), batch_size=16)


@pytest.mark.parametrize(
    "pattern",
    [
        Pattern("in-place projection", InPlaceProjection),
        Pattern("hook and learning rate", HookEveryStep),
        Pattern("autoencoder", Reconstruction, pixel_loader),
    ],
    ids=lambda pattern: pattern.name,
)
def test_a_training_step_with_such_effects_trains_as_without_gradwatch(pattern: Pattern) -> None:
    without, with_checks = fit(pattern, with_watch=False), fit(pattern, with_watch=True, max_overhead=None)
    assert compare(without, with_checks) == []
    reports = with_checks.reports
    assert len(reports) == 4  # steps 1, 2, 4 and 6
    assert all(report.verdict == "ok" for report in reports), [r.summary() for r in reports]
    if pattern.module is Reconstruction:
        assert all(any(n.startswith("input probes skipped") for n in r.notes) for r in with_checks.reports)


def _stepping_loss(module: pl.LightningModule, batch: Any) -> Tensor:
    """A loss_fn that trains by itself (manual optimization's training_step passed as the loss)."""
    optimizer = module.optimizers()
    assert not isinstance(optimizer, list)
    optimizer.zero_grad()
    loss = F.cross_entropy(module(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    return loss


def test_a_loss_fn_that_steps_the_optimizer_skips_the_check_in_gradwatchs_words_and_changes_nothing() -> None:
    pattern = Pattern("steps the optimizer", Classifier)
    without = fit(pattern, with_watch=False)
    with pytest.warns(GradientCheckWarning, match=r"`loss_fn` must return the loss without calling backward\(\)"):
        with_checks = fit(pattern, with_watch=True, loss_fn=_stepping_loss)
    assert with_checks.reports == []
    assert compare(without, with_checks) == []  # parameters and Adam's state put back before the check ended


def test_a_checkpoint_whose_focus_names_a_lost_parameter_resumes_with_every_check_made(tmp_path: Any) -> None:
    pl.seed_everything(0, verbose=False)
    watch = GradWatch(every_n_steps=1, max_overhead=None)
    first = trainer(tmp_path, [watch], max_steps=2, enable_checkpointing=True)
    first.fit(Classifier(), DataLoader(TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,))), batch_size=8))
    path = tmp_path / "renamed.ckpt"
    first.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["callbacks"][watch.state_key]["focus"] = ["encoder.weight", "net.0.weight"]  # a renamed layer
    torch.save(checkpoint, path)

    resumed = GradWatch(every_n_steps=1, max_overhead=None)
    second = trainer(tmp_path, [resumed], max_steps=5)
    loader = DataLoader(TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,))), batch_size=8)
    second.fit(Classifier(), loader, ckpt_path=path)
    assert resumed.counts["skipped"] == 0
    assert len(resumed.recomputed_reports) == 3
    assert all(r.verdict == "ok" for r in resumed.recomputed_reports)
    assert "net.0.weight" in {p.target for p in resumed.recomputed_reports[0].probes}  # the name it still has is probed
