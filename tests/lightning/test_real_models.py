"""The models whose probes must evaluate the user's own function, each fitted by a real Trainer with the GradWatch the
README gives it (default settings): Hugging Face models from tiny configs, a peft LoRA, generative models drawing
noise in their input's dtype, stock surrogate layers, and user surrogates."""

from __future__ import annotations

import importlib.util
import warnings

import lightning.pytorch as pl
import pytest
import torch
from real_models import BUGGY, CORRECT, GAN, RealModel, fit
from torch import nn

from gradwatch import GradientCheckWarning, GradWatch
from gradwatch.engine.results.notes import NoteCode

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")

CONCLUSIVE = ("Hugging Face", "peft", "VAE")
"""Models every check of which must be conclusive."""


def _skip_without(model: RealModel) -> None:
    if model.needs is not None and importlib.util.find_spec(model.needs) is None:
        pytest.skip(f"needs {model.needs}")


@pytest.mark.slow
@pytest.mark.parametrize("model", CORRECT, ids=[m.name for m in CORRECT])
def test_a_correct_model_never_fails(model: RealModel) -> None:
    _skip_without(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, watches = fit(model, steps=2)
    reports = [report for watch in watches for report in watch.recomputed_reports]
    assert reports, "no check ran"
    assert all(report.verdict != "fail" for report in reports), "\n\n".join(map(str, reports))
    if model.name.startswith(CONCLUSIVE):
        assert all(report.verdict == "ok" for report in reports), "\n\n".join(map(str, reports))
        assert all(report.precision == "float64" for report in reports)
    said = [str(w.message) for w in caught if issubclass(w.category, GradientCheckWarning)]
    if model.name == "straight-through fake quantiser":
        assert any("straight-through estimator" in s and "ignore=['quantised.weight']" in s for s in said), said
    else:
        assert not said, said
    if model.module is GAN:  # several optimizers: applied checks per optimizer, each callback its own parameters
        applied = [report for watch in watches for report in watch.applied_reports]
        assert applied, "no applied check ran"
        assert all(report.verdict == "ok" for report in applied), "\n\n".join(map(str, applied))


@pytest.mark.slow
def test_hugging_face_losses_are_probed_in_float64_on_their_own_function() -> None:
    model = next(m for m in CORRECT if m.name == "Hugging Face Llama")
    _skip_without(model)
    _, (watch,) = fit(model, steps=2)
    (report,) = watch.recomputed_reports
    assert report.count("inconclusive") == 0, str(report)
    assert report.noted(NoteCode.FLOAT64_CASTS_KEPT), report.notes


@pytest.mark.slow
@pytest.mark.parametrize("model", BUGGY, ids=[m.name for m in BUGGY])
def test_a_planted_two_percent_bug_is_caught_and_named(model: RealModel) -> None:
    _skip_without(model)
    with pytest.warns(GradientCheckWarning, match="gradient check failed at step 1"):
        _, (watch,) = fit(model, steps=2)
    (report,) = watch.recomputed_reports
    assert report.verdict == "fail", str(report)
    named = {p.target for p in report.failures if p.kind in ("tensor", "random", "param")}
    wrong = "lora_B" if "LoRA" in model.name else "decoder_out"
    assert named, str(report)
    assert all(wrong in target for target in named), str(report)


def test_two_watches_of_a_gan_have_keys_of_their_own() -> None:
    generator, discriminator = (
        GradWatch(loss_fn=GAN.generator_loss),
        GradWatch(loss_fn=GAN.discriminator_loss, ignore=["generator.*"]),
    )
    assert len({generator.state_key, discriminator.state_key, GradWatch().state_key}) == 3
    assert GradWatch().state_key == "GradWatch{'every_n_steps': 500, 'seed': 0}"  # what older checkpoints hold


class _Wrapped(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.ModuleDict({"encoder": nn.Linear(4, 4), "head": nn.Linear(4, 1)})

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model["head"](torch.tanh(self.model["encoder"](batch[0]))).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.slow
def test_an_ignore_pattern_that_matches_nothing_warns_once_with_the_names_meant() -> None:
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4)
    watch = GradWatch(ignore=["encoder.*"], every_n_steps=1, max_overhead=None)
    trainer = pl.Trainer(
        max_steps=3, logger=False, callbacks=[watch], enable_progress_bar=False, enable_checkpointing=False
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Wrapped(), data)
    said = [str(w.message) for w in caught if "matches no parameter" in str(w.message)]
    assert len(said) == 1, said
    assert "'encoder.*'" in said[0]
    assert "'model.encoder.*'" in said[0]
    assert len(watch.recomputed_reports) == 3
