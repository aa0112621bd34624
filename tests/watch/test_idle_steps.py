"""A plain loop's calls on steps where no check is due run no tensor operation and leave no hook behind."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from idle_steps import global_hooks, hooks, recorded
from torch import nn

from gradwatch import GradientWatch
from gradwatch.watch.applied import Windows
from gradwatch.watch.cadence import APPLIED_KEYS, Cadence
from gradwatch.watch.overhead import OverheadClock


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def test_the_calls_of_a_step_with_no_check_due_touch_no_tensor_and_install_no_hook() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = GradientWatch(verbose=False)  # the defaults: both first checks at step 1, the next ones at 500 and 5000
    installed = global_hooks()  # what earlier code left: not the watch's
    operations: list[str] = []
    step = 0
    idle = lambda: step > 1  # noqa: E731
    record, before, maybe_check = (recorded(call, operations, idle) for call in
                                   (watch.record, watch.before_optimizer_step, watch.maybe_check))  # fmt: skip
    watch.setup(model)
    watch.start(0)
    for step in range(1, 7):
        batch = (torch.randn(6, 4), torch.randint(0, 3, (6,)))
        record(batch)
        optimizer.zero_grad()
        _loss(model, batch).backward()
        applied = before(model, _loss, step=step)
        optimizer.step()
        recomputed = maybe_check(model, batch, _loss, step=step)
        if step == 1:  # both kinds checked at the first step: the watch under test works
            assert applied is not None
            assert recomputed is not None
            continue
        assert (applied, recomputed) == (None, None)
        assert operations == [], f"step {step}: the watch ran {operations}"
        assert hooks(model, optimizer, before=installed) == 0, f"step {step}: hooks left installed"
        assert not watch.recording
    assert sorted(report.scope for report in watch.reports) == ["applied", "recomputed", "update"]


_COUNTED = [(nn.Module, "parameters", "parameters"), (nn.Module, "named_parameters", "parameters"),
            (GradientWatch, "_window", "slow path"), (GradientWatch, "_run", "slow path")]  # fmt: skip
"""The per-parameter loops of a model and the watch's own work of a due step, counted by the step they run in."""


def _run(steps: int, monkeypatch: pytest.MonkeyPatch, **options: Any) -> tuple[GradientWatch, dict[str, list[int]]]:
    """A plain loop of ``steps`` steps (2 micro-batches a window, clipped) under a watch whose ``decide`` checks now
    (the budget's decision every process takes, a collective under DDP), with the calls of ``decide`` and of
    :data:`_COUNTED` listed by the step they run in."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    parameters = list(model.parameters())
    optimizer = torch.optim.SGD(parameters, lr=0.1)
    calls: dict[str, list[int]] = {"decide": [], "parameters": [], "slow path": []}
    step = 0

    def decide(proposal: int) -> int:
        calls["decide"].append(step)
        return 0

    def counting(original: Any, key: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[key].append(step)
            return original(*args, **kwargs)

        return call

    watch = GradientWatch(verbose=False, decide=decide, **options)
    watch.setup(model)
    watch.start(0)
    for owner, name, key in _COUNTED:
        monkeypatch.setattr(owner, name, counting(getattr(owner, name), key))
    generator = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        for _ in range(2):
            batch = (torch.randn(6, 4, generator=generator), torch.randint(0, 3, (6,), generator=generator))
            watch.record(batch, model=model)
            (_loss(model, batch) / 2).backward()
        watch.before_optimizer_step(model, _loss, step=step)
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        watch.after_clipping(model, 1.0, step=step)
        optimizer.step()
        optimizer.zero_grad()
        watch.maybe_check(model, batch, _loss, step=step)
    monkeypatch.undo()
    return watch, calls


def test_the_slow_paths_and_the_budgets_decision_run_only_at_the_steps_due(monkeypatch: pytest.MonkeyPatch) -> None:
    # the first checks at step 1, then every 6 steps
    watch, calls = _run(14, monkeypatch, every_n_steps=6, applied_every_n_steps=6)
    checked = {report.step for report in watch.reports}
    applied = {report.step for report in watch.applied_reports}
    assert checked == {1, 6, 12}, [(r.scope, r.step) for r in watch.reports]
    assert set(calls["decide"]) == checked  # decided at each check's step, at no other: every rank in lockstep
    # the step before an applied check keeps its gradient for the update check: its gradient's per-parameter work
    allowed = checked | {step - 1 for step in applied}
    assert set(calls["parameters"]) <= allowed
    assert set(calls["slow path"]) <= allowed
    assert len(set(range(1, 15)) - allowed) >= 8  # the idle steps this asserts about: 2-4, 7-10, 13-14


def test_a_due_check_comes_at_the_same_step_with_the_same_report_as_without_the_fast_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast, _ = _run(14, monkeypatch, every_n_steps=6, applied_every_n_steps=6)
    monkeypatch.setattr(Windows, "idle", lambda self, step: False)  # before_optimizer_step's slow path at every step
    slow, _ = _run(14, monkeypatch, every_n_steps=6, applied_every_n_steps=6)

    def summary(watch: GradientWatch) -> list[tuple[Any, ...]]:
        return [(r.scope, r.step, r.verdict, r.n_forward, r.n_backward, [p.evaluations for p in r.probes])
                for r in watch.reports]  # fmt: skip

    assert summary(fast) == summary(slow)
    assert len(fast.reports) >= 7
    timing = {"train_seconds", "check_seconds", "applied_seconds", "first_seconds", "last_check_seconds",
              "applied_last_seconds"}  # fmt: skip
    assert {k: v for k, v in fast.state_dict().items() if k not in timing} == {
        k: v for k, v in slow.state_dict().items() if k not in timing
    }


def test_a_window_is_idle_unless_kept_or_leading_to_the_step_before_a_due_one() -> None:
    windows = Windows(Cadence("applied", 5, 2, None, OverheadClock(), keys=APPLIED_KEYS))
    idle = {}
    for step in range(1, 12):
        if windows.begin(step, lambda wait: wait):
            windows.record(object(), None)
        idle[step] = windows.idle(step)
        windows.take(step)
    # due: 2 (the first check), 5 and 10; the steps before them keep their gradient for the update check
    assert [step for step, quiet in idle.items() if not quiet] == [1, 2, 4, 5, 9, 10]
    assert not windows.idle(12)  # no window begun for it (a loop that did not call record): the slow path says so
