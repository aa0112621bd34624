"""The update check through ``GradientWatch`` in a plain loop: on by default wherever the applied check runs, from the
watch's own step hooks (no new line in the loop), its reports beside the other kinds; healthy optimizers pass, the
planted faults of tests/update_models.py fail at the first update check naming their tensor, and training is bit for
bit the same with and without the watch."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import update_models as models

from gradwatch import GradientWatch
from gradwatch.cli.reporting import format_run
from gradwatch.outputs.reading import read_logdir
from gradwatch.outputs.sinks import JsonLinesSink

Make = Callable[[torch.nn.Module], Any]


def _watch(**options: Any) -> GradientWatch:
    options = {
        "every_n_steps": 1000,
        "first_check_step": 1,
        "applied_every_n_steps": 5,
        "max_overhead": None,
        **options,
    }
    return GradientWatch(verbose=False, **options)


def loop(
    watch: GradientWatch | None, make: Make, *, steps: int, tell: str = "optimizers", clip: float | None = None,
    clip_before_backward: bool = False, seed: int = 0,
) -> tuple[torch.nn.Module, Any, Any]:  # fmt: skip
    """A plain loop with an LR scheduler; ``tell``: how the watch learns the optimizer (``"optimizers"``,
    ``"optimizer"``, ``"nothing"``: its global step hooks find it)."""
    model = models.mlp(seed=seed)
    optimizer = make(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 7, 0.7)
    torch.manual_seed(seed + 1)
    for step in range(1, steps + 1):
        item = models.batch()
        if watch is not None:
            watch.record(item)
        model.zero_grad()  # every gradient: a Muon updates the matrices alone
        if clip_before_backward:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # the bug: nothing to clip yet
        models.loss_fn(model, item).backward()
        if watch is not None:
            told = {"optimizers": {"optimizers": [optimizer]}, "optimizer": {"optimizer": optimizer}}.get(tell, {})
            declared = {"max_norm": clip} if clip is not None else {}
            watch.before_optimizer_step(model, models.loss_fn, step=step, **told, **declared)
        if clip is not None and not clip_before_backward:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        if watch is not None:
            watch.maybe_check(model, item, models.loss_fn, step=step)
    return model, optimizer, scheduler


ADAMW = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, amsgrad=True)  # noqa: E731


@pytest.mark.parametrize("tell", ["optimizers", "optimizer", "nothing"])
def test_healthy_plain_loop_checks_every_verified_update(tell: str) -> None:
    watch = _watch()
    loop(watch, ADAMW, steps=50, tell=tell, clip=0.05)  # the gradient copied before the clip, whatever finds the step
    updates, applied = watch.update_reports, watch.applied_reports
    assert len(updates) == len(applied) == 11  # step 1, then every 5
    assert [r.step for r in updates] == [r.step for r in applied]
    assert all(r.verdict == "ok" for r in updates), [str(r) for r in updates if r.verdict != "ok"][:1]
    assert watch.counts["update_checks"] == 11
    assert watch.counts["update_failed"] == 0
    assert [r.scope for r in watch.reports[:3]] == ["applied", "update", "recomputed"]


def test_healthy_muon_with_a_declared_clip() -> None:
    watch = _watch()
    loop(watch, lambda m: torch.optim.Muon([p for p in m.parameters() if p.ndim == 2], lr=0.02), steps=50, clip=0.05)
    assert len(watch.update_reports) == 11
    assert all(r.verdict == "ok" for r in watch.update_reports)


@pytest.mark.parametrize("tell", ["optimizers", "nothing"])
def test_healthy_adamw_with_a_clip_whichever_way_the_watch_finds_the_optimizer(tell: str) -> None:
    # found by its global step hooks, the snapshot is taken after clip_grad_norm_ scaled .grad in place: the reference
    # must start from the gradient the applied check verified, not clip the clipped one again
    watch = _watch()
    loop(watch, ADAMW, steps=12, tell=tell, clip=0.05)
    assert len(watch.update_reports) == 3
    assert all(r.verdict == "ok" for r in watch.update_reports), [str(r) for r in watch.update_reports][:1]


@pytest.mark.parametrize("tell", ["optimizers", "nothing"])
def test_a_clip_the_loop_does_not_declare_is_no_failure_and_is_said(tell: str) -> None:
    # clip_grad_norm_ called and not told to the watch: the optimizer steps with the verified gradient times one
    # factor below 1, which is what a norm clip does; the update is checked from it and a note says how to declare it
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731 (not scale-invariant)
    reports = _undeclared_clip_loop(_watch(), sgd, tell)
    assert [r.verdict for r in reports] == ["ok"] * 3, [str(r) for r in reports][:1]
    assert all(any(n.code == "update-undeclared-clip" for n in r.notes) for r in reports)


def _undeclared_clip_loop(watch: GradientWatch, make: Make, tell: str) -> list[Any]:
    model = models.mlp(seed=0)
    optimizer = make(model)
    torch.manual_seed(1)
    for step in range(1, 13):
        item = models.batch()
        watch.record(item)
        model.zero_grad()
        models.loss_fn(model, item).backward()
        told = {"optimizers": [optimizer]} if tell == "optimizers" else {}
        watch.before_optimizer_step(model, models.loss_fn, step=step, **told)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # clips at every step, not declared
        optimizer.step()
        watch.maybe_check(model, item, models.loss_fn, step=step)
    return watch.update_reports


def test_check_update_false_makes_none() -> None:
    watch = _watch(check_update=False)
    loop(watch, ADAMW, steps=6)
    assert watch.update_reports == []
    assert len(watch.applied_reports) == 2


def test_training_is_bit_identical_with_and_without_the_update_check() -> None:
    def state(run: tuple[torch.nn.Module, Any, Any]) -> tuple[list[torch.Tensor], dict, dict]:
        model, optimizer, scheduler = run
        return [p.detach().clone() for p in model.parameters()], optimizer.state_dict(), scheduler.state_dict()

    make = lambda m: torch.optim.Muon([p for p in m.parameters() if p.ndim == 2], lr=0.02)  # noqa: E731
    for tell in ("optimizers", "nothing"):
        watch = _watch(applied_every_n_steps=2)
        params, opt, sched = state(loop(None, make, steps=8, clip=0.5))
        params_w, opt_w, sched_w = state(loop(watch, make, steps=8, tell=tell, clip=0.5))
        assert len(watch.update_reports) == 5
        assert all(torch.equal(a, b) for a, b in zip(params, params_w, strict=True))
        assert opt["param_groups"] == opt_w["param_groups"]
        for key, entry in opt["state"].items():
            assert all(torch.equal(v, opt_w["state"][key][k]) for k, v in entry.items())
        assert sched == sched_w


def test_the_hooks_go_and_leave_the_loops_own_hooks_working() -> None:
    watch = _watch(applied_every_n_steps=1)
    model = models.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[int] = []
    optimizer.register_step_post_hook(lambda *_: seen.append(1))  # after the watch's: torch runs both
    for step in range(1, 4):
        item = models.batch()
        watch.record(item)
        models.loss_fn(model, item).backward()
        watch.before_optimizer_step(model, models.loss_fn, step=step, optimizers=[optimizer])
        optimizer.step()
        optimizer.zero_grad()
        assert watch.after_optimizer_step(optimizer, step=step) is watch.update_reports[-1]
    assert seen == [1, 1, 1]
    assert len(optimizer._optimizer_step_post_hooks) == 1  # the watch's own are gone
    assert len(watch.update_reports) == 3


FAULTS = {
    "muon-row-blocks": lambda m: models.RowShardedMuon([p for p in m.parameters() if p.ndim == 2], lr=0.02),
    "muon-no-newton-schulz": lambda m: models.NoNewtonSchulzMuon([p for p in m.parameters() if p.ndim == 2], lr=0.02),
    "adamw-decay-twice": lambda m: models.TwiceDecayedAdamW(m.parameters(), lr=1e-3, weight_decay=0.1),
    "adam-late-bias-correction": lambda m: models.LateBiasCorrectionAdam(m.parameters(), lr=1e-3),
}


@pytest.mark.parametrize("name", list(FAULTS), ids=list(FAULTS))
def test_a_wrong_update_fails_the_first_update_check(name: str) -> None:
    first = 5 if name == "adam-late-bias-correction" else 1  # at step 1 its bias correction is right
    watch = _watch(first_check_step=None if first > 1 else 1)
    loop(watch, FAULTS[name], steps=first)
    report = watch.update_reports[0]
    assert report.step == first
    assert report.verdict == "fail", str(report)
    assert report.fault == "update"
    assert f"the update of `{report.failures[0].target}`" in report.fault_message
    assert all(r.verdict == "ok" for r in watch.applied_reports)  # the gradient was right


def test_a_step_with_the_previous_gradient_is_caught() -> None:
    watch = _watch(first_check_step=None, applied_every_n_steps=3)
    loop(watch, lambda m: models.StaleGradientSGD(m.parameters(), lr=0.05, momentum=0.9), steps=3)
    report = watch.update_reports[0]
    assert report.step == 3
    assert report.verdict == "fail", str(report)
    assert report.fault == "gradient"
    # the previous step's gradient, or the .grad torch's hooks see inside SGD.step (stale there): not the verified one
    assert "not the verified one" in report.fault_message


def test_clip_grad_norm_before_backward_is_a_clipping_fault() -> None:
    watch = _watch()
    loop(watch, ADAMW, steps=1, clip=0.05, clip_before_backward=True)
    report = watch.update_reports[0]
    assert report.verdict == "fail", str(report)
    assert report.fault == "clipping"
    assert f"the update of `{report.failures[0].target}`" in report.fault_message


def test_update_checks_are_recorded_and_reported(tmp_path: Path) -> None:
    watch = _watch(sinks=[JsonLinesSink(tmp_path / "gradwatch.jsonl")])
    loop(watch, lambda m: models.NoNewtonSchulzMuon([p for p in m.parameters() if p.ndim == 2], lr=0.02), steps=6)
    watch.flush()
    lines = [json.loads(line) for line in (tmp_path / "gradwatch.jsonl").read_text().splitlines()]
    updates = [line for line in lines if line.get("scope") == "update"]
    assert [u["step"] for u in updates] == [1, 5]
    assert updates[0]["fault"] == "update"
    assert "gradwatch/update/verdict" in updates[0]["scalars"]
    (run,) = read_logdir(tmp_path)
    assert [u.step for u in run.updates] == [1, 5]
    assert len(run.checks) == 1  # the recomputed check alone: update checks are not read as recomputed ones
    text = format_run(run)
    assert "update checks (the update the optimizer made): 2, 0 ok, 0 inconclusive, 2 fail" in text
    assert "update fault at step 1: the update of `" in text
