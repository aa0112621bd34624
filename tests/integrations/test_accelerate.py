"""The Accelerate recipe of docs/loops.md, run: GradientWatch's three calls inside ``accelerator.accumulate`` (one
optimizer step per two micro-batches), both kinds of check logged through ``accelerator.log`` (a ``LogCallSink``) and
kept in the run's ``gradwatch.jsonl`` (a ``JsonLinesSink``), which ``gradwatch report`` reads: the recomputed and the
applied checks of the run; training bit for bit as without."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from loop_models import MLP, assert_same_state, classification_batches, cross_entropy, state_of

from gradwatch import GradientWatch
from gradwatch.cli import main
from gradwatch.outputs import JsonLinesSink, LogCallSink

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


def _train(watch: GradientWatch | None, tracker: Any = None, project_dir: Path | None = None) -> dict[str, Any]:
    """The recipe of docs/loops.md, with the watch's sinks given here (``LogCallSink(accelerator.log)``, and the
    record in ``project_dir`` on the main process)."""
    accelerator = accelerate.Accelerator(
        cpu=True, gradient_accumulation_steps=2, log_with=tracker, project_dir=project_dir
    )
    if tracker is not None:
        accelerator.init_trackers("run")
    if watch is not None:
        record = [JsonLinesSink(project_dir / "gradwatch.jsonl")] if project_dir and accelerator.is_main_process else []
        watch.sinks = [LogCallSink(accelerator.log), *record]
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    module = accelerator.unwrap_model(model)
    step = 0
    for batch in classification_batches(12):
        with accelerator.accumulate(model):
            if watch is not None:
                watch.record(batch)
            accelerator.backward(cross_entropy(model, batch))
            if accelerator.sync_gradients and watch is not None:
                watch.before_optimizer_step(module, cross_entropy, step=step + 1, path=accelerator.autocast)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients and watch is not None:
            step += 1
            watch.maybe_check(
                module, batch, cross_entropy, step=step, skipped=lambda: accelerator.optimizer_step_was_skipped
            )
    accelerator.end_training()
    return state_of(accelerator.unwrap_model(model), optimizer.optimizer)


def test_the_accelerate_recipe_checks_both_kinds_logs_both_and_trains_as_without() -> None:
    watch, tracker = GradientWatch(every_n_steps=2, max_overhead=None, applied_every_n_steps=4), _Tracker()
    watched = _train(watch, tracker)
    assert [(r.step, r.verdict) for r in watch.recomputed_reports] == [(1, "ok"), (2, "ok"), (4, "ok"), (6, "ok")]
    assert [(r.step, r.verdict) for r in watch.applied_reports] == [(1, "ok"), (4, "ok")]
    assert [step for step, values in tracker.logged if "gradwatch/verdict" in values] == [1, 2, 4, 6]
    assert [step for step, values in tracker.logged if "gradwatch/applied/verdict" in values] == [1, 4]
    assert_same_state(_train(None), watched)


@pytest.mark.slow
def test_gradwatch_report_reads_both_kinds_of_check_of_the_recipes_tensorboard_run(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    watch = GradientWatch(every_n_steps=2, max_overhead=None, applied_every_n_steps=4)
    _train(watch, "tensorboard", tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["report", str(tmp_path)])
    printed = out.getvalue()
    assert code == 0, printed
    assert "applied checks (the gradient the optimizer applied): 2" in printed
