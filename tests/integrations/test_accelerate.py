"""The Accelerate recipe of docs/loops.md, run: GradientWatch called when ``accelerator.sync_gradients`` (one call per
optimizer step under gradient accumulation 2), scalars through ``accelerator.log``, training bit for bit as without."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from loop_models import MLP, assert_same_state, classification_batches, cross_entropy, state_of

from gradwatch import GradientWatch

accelerate = pytest.importorskip("accelerate")


class _Tracker(accelerate.tracking.GeneralTracker):
    """Records what ``accelerator.log`` sends, as any tracker (TensorBoard, W&B, MLflow) receives it."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict[str, float]]] = []

    @property
    def tracker(self) -> Any:
        return self

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        pass

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.logged.append((step or 0, dict(values)))


def _train(watch: GradientWatch | None, tracker: _Tracker | None = None) -> dict[str, Any]:
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2, log_with=tracker)
    if tracker is not None:
        accelerator.init_trackers("run")
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    step = 0
    for batch in classification_batches(12):
        with accelerator.accumulate(model):
            accelerator.backward(cross_entropy(model, batch))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients and watch is not None:
            step += 1
            report = watch.maybe_check(
                accelerator.unwrap_model(model),
                batch,
                cross_entropy,
                step=step,
                skipped=lambda: accelerator.optimizer_step_was_skipped,
            )
            if report is not None:
                accelerator.log({k: v for k, v in report.scalars().items() if v == v}, step=step)
    accelerator.end_training()
    return state_of(accelerator.unwrap_model(model), optimizer.optimizer)


def test_the_accelerate_recipe_checks_optimizer_steps_and_trains_as_without() -> None:
    watch, tracker = GradientWatch(every_n_steps=2), _Tracker()
    watched = _train(watch, tracker)
    assert [(r.step, r.verdict) for r in watch.reports] == [(1, "ok"), (2, "ok"), (4, "ok"), (6, "ok")]
    assert [step for step, values in tracker.logged if "gradwatch/verdict" in values] == [1, 2, 4, 6]
    assert_same_state(_train(None), watched)
