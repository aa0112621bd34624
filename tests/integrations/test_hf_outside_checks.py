"""The Hugging Face callback never ends a Trainer run: an error injected at a call its hooks make outside a check
(recording a micro-batch and its checksums, the clip check's norms, the run's sinks, the state it keeps in the
Trainer's checkpoints, the path of the applied check) is reported once and the run trains bit for bit as without it."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loop_models import Tokens, assert_same_state, state_of, tiny_llama  # noqa: E402

import gradwatch.engine.applied.clipping as clipping  # noqa: E402
import gradwatch.engine.applied.window as window  # noqa: E402
import gradwatch.integrations.huggingface as huggingface  # noqa: E402
from gradwatch.integrations.huggingface import GradWatchCallback  # noqa: E402

pytestmark = pytest.mark.slow

SITES: list[tuple[Any, str]] = [
    (window.Checksums, "of"),
    (clipping.GradientNorms, "of"),
    (huggingface, "run_sinks"),
    (huggingface, "_stateful"),
    (huggingface, "TrainerPath"),
]


class InjectedError(RuntimeError):
    """The error planted at a call site."""


def _train(tmp_path: Path, watched: bool) -> tuple[Any, GradWatchCallback | None]:
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), gradient_accumulation_steps=2, per_device_train_batch_size=4, max_steps=2,
        report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True,
        dataloader_num_workers=0, max_grad_norm=1.0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=tiny_llama(), args=arguments, train_dataset=Tokens())
    callback = None
    if watched:
        callback = GradWatchCallback(trainer, every_n_steps=1, applied_every_n_steps=1, max_overhead=None)
        trainer.add_callback(callback)
    trainer.train()
    return trainer, callback


@pytest.fixture(scope="module")
def unwatched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    trainer, _ = _train(tmp_path_factory.mktemp("without"), watched=False)
    return state_of(trainer.model, trainer.optimizer)


@pytest.mark.parametrize("site", SITES, ids=lambda site: f"{getattr(site[0], '__name__', site[0])}.{site[1]}")
def test_an_error_at_a_call_site_of_the_callback_is_reported_once_and_training_goes_on(
    site: tuple[Any, str], unwatched: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, name = site
    marker = f"injected at {name}"
    calls: list[int] = []

    def raising(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise InjectedError(marker)

    monkeypatch.setattr(owner, name, raising)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, callback = _train(tmp_path, watched=True)
    assert callback is not None
    assert calls, "the site was never called: the test does not reach it"
    assert_same_state(unwatched, state_of(trainer.model, trainer.optimizer))
    assert len([note for note in callback.watch.notes if marker in note]) == 1, callback.watch.notes
    said = [str(w.message) for w in caught if marker in str(w.message) and "training goes on" in str(w.message)]
    assert len(said) == 1, said
    assert torch.is_grad_enabled()
