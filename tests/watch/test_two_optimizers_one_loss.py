"""Two optimizers on one loss in a plain loop (Muon for the matrices, AdamW for the rest, each stepping in turn after
one backward), each named as docs/loops.md's recipe says: ``record(batch, optimizer=...)`` for each before the one
forward, ``before_optimizer_step(..., optimizer=...)`` from a step pre-hook of each. The second optimizer's gradient is
checked at the point its backward ran, not at the parameters the first optimizer's step has moved since: a healthy
model is clean for 20 steps and trains bit for bit as without the watch; a step pre-hook scaling one tensor's gradient
before the second optimizer's step is caught, that tensor named."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradwatch import GradientWatch

STEPS = 20


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _scale_bias(model: nn.Module, factor: float) -> Any:
    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            model[2].bias.grad.mul_(factor)

    return hook


def one_loss_loop(watch: GradientWatch | None, *, fault: float | None = None) -> dict[str, Any]:
    """Muon on the 2-D weights, AdamW on the biases, one loss, one backward, both steps after it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    muon = torch.optim.Muon(matrices, lr=0.02)
    adamw = torch.optim.AdamW(rest, lr=1e-2)
    optimizers = (muon, adamw)
    if fault is not None:
        adamw.register_step_pre_hook(_scale_bias(model, fault))
    step = 0
    if watch is not None:
        for optimizer in optimizers:

            def check(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
                watch.before_optimizer_step(model, _loss, step=step, optimizer=opt)

            optimizer.register_step_pre_hook(check)
    generator = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        batch = (torch.randn(16, 6, generator=generator), torch.randn(16, 3, generator=generator))
        if watch is not None:
            for optimizer in optimizers:
                watch.record(batch, step=step, optimizer=optimizer)
        for optimizer in optimizers:
            optimizer.zero_grad()
        _loss(model, batch).backward()
        for optimizer in optimizers:
            optimizer.step()
    return {
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "optimizers": [str(o.state_dict()) for o in optimizers],
    }


def _watch(**kwargs: Any) -> GradientWatch:
    return GradientWatch(
        applied_every_n_steps=1, every_n_steps=10**6, max_overhead=None, first_check_step=None, **kwargs
    )


def test_two_optimizers_on_one_loss_are_clean_for_20_steps_and_train_as_without_the_watch() -> None:
    watch = _watch(on_fail="raise")
    with_watch, without = one_loss_loop(watch), one_loss_loop(None)
    applied = watch.applied_reports
    assert len(applied) == 2 * STEPS
    assert all(report.verdict == "ok" for report in applied), [r.summary() for r in applied if r.verdict != "ok"]
    assert not [r for r in watch.reports if r.verdict == "fail"], [r.summary() for r in watch.reports]
    assert watch.counts["applied_failed"] == 0
    updates = watch.update_reports  # each optimizer's update of the gradient its check verified
    assert [r.step for r in updates] == [step for step in range(1, STEPS + 1) for _ in range(2)]
    assert all(r.verdict == "ok" for r in updates), [r.summary() for r in updates if r.verdict != "ok"]
    for name, tensor in without["params"].items():
        assert torch.equal(tensor, with_watch["params"][name]), name
    assert with_watch["optimizers"] == without["optimizers"]


def test_a_pre_hook_scaling_one_tensors_gradient_before_the_second_step_is_caught() -> None:
    watch = _watch(on_fail=lambda report: None)
    one_loss_loop(watch, fault=1.5)
    applied = watch.applied_reports
    muon, adamw = applied[0::2], applied[1::2]
    assert all(report.verdict == "ok" for report in muon), [r.summary() for r in muon if r.verdict != "ok"]
    assert all(report.verdict == "fail" for report in adamw), [r.summary() for r in adamw]
    assert [r.fault for r in adamw] == ["modified"] * STEPS
    failing = {p.target for p in adamw[0].probes if p.verdict == "fail" and p.target != "*"}
    assert failing == {"2.bias"}, failing
