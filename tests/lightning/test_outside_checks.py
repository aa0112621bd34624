"""Lightning's GradWatch never ends a run: an error injected at each call its hooks make outside a check is reported
once and the fit trains bit for bit as without the callback; a Fourier neural operator (complex spectral weights)
under ``GradWatch()`` at its defaults, both kinds of check and the clip coefficient's, completes bit-identically with
no failing check (it crashed at step 1 in the clip bookkeeping before)."""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from dtype_models import FNO, field_batches, field_loss

import gradwatch.engine.applied.clipping as clipping
import gradwatch.engine.applied.window as window
import gradwatch.integrations.lightning.callback as callback
import gradwatch.integrations.lightning.publishing as publishing
import gradwatch.watch.applied as applied
import gradwatch.watch.cadence as cadence
from gradwatch import GradientCheckWarning, GradWatch

pytestmark = pytest.mark.slow

MAX_NORM = 0.05


class FieldModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = FNO()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = field_loss(self.model, batch)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _fit(watch: GradWatch | None) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    module = FieldModule()
    trainer = pl.Trainer(
        default_root_dir=tempfile.mkdtemp(prefix="gradwatch-outside-"),
        accelerator="cpu",
        devices=1,
        max_steps=3,
        gradient_clip_val=MAX_NORM,
        log_every_n_steps=1,
        callbacks=[watch] if watch is not None else [],
        enable_progress_bar=watch is not None,  # the progress bar's status is one of the sites
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(field_batches(3), batch_size=None))
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def _assert_same(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> None:
    assert first.keys() == second.keys()
    for name, value in first.items():
        assert torch.equal(value, second[name]), name


def test_an_fno_under_gradwatch_at_its_defaults_trains_as_without_it() -> None:
    unwatched = _fit(None)
    watch = GradWatch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watched = _fit(watch)
    _assert_same(unwatched, watched)
    assert not watch.watch.notes
    assert not [w for w in caught if issubclass(w.category, GradientCheckWarning)], [str(w.message) for w in caught]
    scopes = [(report.scope, bool(report.probes)) for report in watch.reports]
    assert ("recomputed", True) in scopes
    assert ("applied", True) in scopes  # the applied check
    assert ("applied", False) in scopes  # the clip coefficient's
    assert all(report.verdict != "fail" for report in watch.reports), [r.summary() for r in watch.reports]


SITES: list[tuple[Any, str]] = [
    (window.Checksums, "of"),
    (clipping.GradientNorms, "of"),
    (applied.Windows, "record"),
    (cadence.Cadence, "reached"),
    (callback, "publish_dashboard"),
    (callback, "lightning_runs"),
    (callback, "show_in_progress_bar"),
    (callback, "training_step_loss"),
    (callback, "_grad_scaler"),
    (publishing.TrainerSink, "write"),
]


class InjectedError(RuntimeError):
    """The error planted at a call site."""


@pytest.fixture(scope="module")
def unwatched() -> dict[str, torch.Tensor]:
    return _fit(None)


@pytest.mark.parametrize("site", SITES, ids=lambda site: f"{getattr(site[0], '__name__', site[0])}.{site[1]}")
def test_an_error_at_a_call_site_of_the_callback_is_reported_once_and_the_fit_goes_on(
    site: tuple[Any, str], unwatched: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, name = site
    marker = f"injected at {name}"
    calls: list[int] = []

    def raising(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise InjectedError(marker)

    monkeypatch.setattr(owner, name, raising)
    watch = GradWatch(every_n_steps=1, max_overhead=None, applied_every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watched = _fit(watch)
    assert calls, "the site was never called: the test does not reach it"
    _assert_same(unwatched, watched)
    assert len([note for note in watch.watch.notes if marker in note]) == 1, watch.watch.notes
    said = [str(w.message) for w in caught if marker in str(w.message) and "training goes on" in str(w.message)]
    assert len(said) == 1, said
