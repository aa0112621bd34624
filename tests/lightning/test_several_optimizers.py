"""GradWatch's applied checks per optimizer under Lightning's manual optimization (a GAN, as docs/lightning.md
recommends: ``toggle_optimizer``, ``self.manual_backward``, ``opt_g.step()``, ``opt_d.step()``): each optimizer's step
checked against the step's own loss (``training_step`` run again from the batch's start, its optimizers held), the
parameters that optimizer updates alone. A healthy GAN is clean and trains bit for bit as without gradwatch; a step
pre-hook scaling the discriminator's gradient ×1.5 fails the discriminator's checks, naming its parameters."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gan_models import GAN, LATENT, _bce, real_batches, scale_on_step
from helpers import trainer

from gradwatch import GradientCheckWarning, GradWatch

pytestmark = pytest.mark.slow


class LitGAN(pl.LightningModule):
    """Lightning's basic GAN recipe: the generator's step, then the discriminator's on a sample made again after it."""

    def __init__(self, fault: float | None = None, closure: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gan = GAN()
        self.fault, self.closure = fault, closure

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        z = torch.randn(real.shape[0], LATENT).type_as(real)
        self.toggle_optimizer(opt_g)
        g_loss = _bce(self.gan.discriminator(self.gan.generator(z)), 1.0)
        self.log("g_loss", g_loss)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)

        def d_step() -> Tensor:
            fake = self.gan.generator(z).detach()
            d_loss = (_bce(self.gan.discriminator(real), 1.0) + _bce(self.gan.discriminator(fake), 0.0)) / 2
            self.manual_backward(d_loss)
            return d_loss

        if self.closure:
            opt_d.step(closure=d_step)
        else:
            d_step()
            opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.Adam(self.gan.generator.parameters(), lr=1e-2)
        opt_d = torch.optim.Adam(self.gan.discriminator.parameters(), lr=1e-2)
        if self.fault is not None:
            opt_d.register_step_pre_hook(scale_on_step(self.fault))
        return [opt_g, opt_d]


def _fit(tmp_path: Path, watch: GradWatch | None, **options: Any) -> LitGAN:
    torch.manual_seed(0)
    module = LitGAN(**options)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(real_batches(3))), batch_size=8)
    trainer(tmp_path, [watch] if watch is not None else [], max_steps=6).fit(module, loader)
    return module


def _watch(**options: Any) -> GradWatch:
    return GradWatch(
        applied_every_n_steps=1, every_n_steps=10**6, first_check_step=None, max_overhead=None,
        loss_fn=lambda module, batch: _bce(module.gan.discriminator(batch[0]), 1.0), **options,
    )  # fmt: skip


@pytest.mark.parametrize("closure", [False, True], ids=["step", "closure"])
def test_a_healthy_gan_is_checked_per_optimizer_and_trains_as_without(tmp_path: Path, closure: bool) -> None:
    watch = _watch(on_fail="raise")
    checked, plain = _fit(tmp_path, watch, closure=closure), _fit(tmp_path, None, closure=closure)
    reports = watch.applied_reports
    assert len(reports) == 6  # 3 batches × 2 optimizers
    assert all(r.verdict == "ok" for r in reports), "\n".join(str(r) for r in reports)
    for report, part in zip(reports, ["generator", "discriminator"] * 3, strict=True):
        assert {p.target.split(".")[1] for p in report.probes if p.target != "*"} <= {part}
    for (name, a), (_, b) in zip(checked.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(checked.trainer.optimizers, plain.trainer.optimizers, strict=True):
        assert str(a.state_dict()) == str(b.state_dict())
    assert all(p.requires_grad for p in checked.parameters())  # every toggle undone


def test_a_step_pre_hook_scaling_the_discriminators_gradient_fails_its_checks(tmp_path: Path) -> None:
    watch = _watch()
    with pytest.warns(GradientCheckWarning, match="applied gradient check failed"):
        _fit(tmp_path, watch, fault=1.5)
    reports = watch.applied_reports
    generator, discriminator = reports[0::2], reports[1::2]
    assert [r.verdict for r in generator] == ["ok"] * 3, "\n".join(str(r) for r in generator)
    assert [r.verdict for r in discriminator] == ["fail"] * 3, "\n".join(str(r) for r in discriminator)
    failing = {p.target for r in discriminator for p in r.probes if p.verdict == "fail" and p.target != "*"}
    assert failing
    assert all(name.startswith("gan.discriminator.") for name in failing)
    assert all(r.descent_ratio == pytest.approx(1 / 1.5, rel=1e-3) for r in discriminator)
    assert [r.fault for r in discriminator] == ["modified"] * 3  # the optimizer's step pre-hook: not a one-off


class StaleSampleGAN(LitGAN):
    """The generator steps first; the discriminator then steps twice (a critic's extra step), each time on the sample
    made before the generator's step: a function of the generator's parameters as they were, which the run-again
    ``training_step`` must see as training did."""

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        fake = self.gan.generator(torch.randn(real.shape[0], LATENT).type_as(real))
        opt_g.zero_grad()
        self.manual_backward(_bce(self.gan.discriminator(fake), 1.0))
        opt_g.step()
        for _ in range(2):
            opt_d.zero_grad()
            self.manual_backward(
                _bce(self.gan.discriminator(real), 1.0) + _bce(self.gan.discriminator(fake.detach()), 0.0)
            )
            opt_d.step()


@pytest.mark.parametrize("fault", [None, 1.5], ids=["healthy", "pre-hook"])
def test_a_sample_made_before_an_earlier_step_is_the_trainings(tmp_path: Path, fault: float | None) -> None:
    """No false alarm where the discriminator trains on a sample the generator made before its own update (the run-again
    ``training_step`` sees the generator's parameters as they were), and the pre-hook still caught."""
    watch = _watch()
    torch.manual_seed(0)
    module = StaleSampleGAN(fault=fault)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(real_batches(2))), batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradientCheckWarning)
        trainer(tmp_path, [watch], max_steps=6).fit(module, loader)
    verdicts = [r.verdict for r in watch.applied_reports]
    assert verdicts == ["ok", "ok", "ok"] * 2 if fault is None else ["ok", "fail", "fail"] * 2, verdicts
