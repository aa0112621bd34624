"""GradientWatch in a Lightning Fabric loop (``Fabric(accelerator="cpu", devices=1)``), the recipe of docs/loops.md:
checks on schedule, training bit for bit as without it, a planted 2% bug caught at the first check with its module."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from loop_models import MLP, assert_same_state, classification_batches, cross_entropy, plant_bug, state_of

from gradwatch import GradientCheckWarning, GradientWatch
from gradwatch.outputs import LogCallSink


def _train(watch: GradientWatch | None, steps: int = 6, bug: bool = False, check: str = "module") -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.seed_everything(0, verbose=False)
    model = MLP()
    if bug:
        plant_bug(model.layers[3])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    for step, batch in enumerate(classification_batches(steps), start=1):
        batch = fabric.to_device(batch)
        optimizer.zero_grad()
        fabric.backward(cross_entropy(model, batch))
        optimizer.step()
        if watch is not None:
            # the module Fabric wraps (model.module, the recipe), or the wrapper itself, which holds the module twice
            watch.maybe_check(model.module if check == "module" else model, batch, cross_entropy, step=step)
    return state_of(model.module, optimizer.optimizer)


@pytest.mark.parametrize("check", ["module", "wrapper"])
def test_a_fabric_loop_checks_on_schedule_and_trains_as_without_the_watch(check: str) -> None:
    watch = GradientWatch(every_n_steps=2, max_overhead=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        watched = _train(watch, check=check)
    assert [(r.step, r.verdict) for r in watch.reports] == [(1, "ok"), (2, "ok"), (4, "ok"), (6, "ok")]
    assert_same_state(_train(None), watched)


def test_a_planted_bug_is_caught_at_the_first_check_with_its_module() -> None:
    watch = GradientWatch(every_n_steps=2, max_overhead=None, on_fail=lambda report: None)
    _train(watch, bug=True)
    first = watch.reports[0]
    assert (first.step, first.verdict) == (1, "fail")
    assert first.culprits[0] == "layers.3"


def test_the_recipes_sink_logs_both_kinds_of_check_through_fabric_log_dict(tmp_path: Path) -> None:
    """``GradientWatch(sinks=[LogCallSink(fabric.log_dict)])``, the recipe: the recomputed and the applied checks reach
    Fabric's loggers (here a CSV logger read back), each under its own tags, at the steps they ran."""
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[CSVLogger(tmp_path, name="run")])
    fabric.seed_everything(0, verbose=False)
    model = MLP()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    watch = GradientWatch(
        every_n_steps=2, max_overhead=None, applied_every_n_steps=2, sinks=[LogCallSink(fabric.log_dict)]
    )
    for step, batch in enumerate(classification_batches(4), start=1):
        watch.record(batch)
        fabric.backward(cross_entropy(model, batch))
        watch.before_optimizer_step(model.module, cross_entropy, step=step, path=fabric.autocast)
        optimizer.step()
        optimizer.zero_grad()
        watch.maybe_check(model.module, batch, cross_entropy, step=step)
    fabric.logger.finalize("success")
    (metrics,) = tmp_path.glob("run/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    assert sorted({int(r["step"]) for r in rows if r.get("gradwatch/verdict")}) == [1, 2, 4]
    assert sorted({int(r["step"]) for r in rows if r.get("gradwatch/applied/verdict")}) == [1, 2, 4]
