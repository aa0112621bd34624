"""A plain loop's calls on steps where no check is due run no tensor operation and leave no hook behind."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from idle_steps import global_hooks, hooks, recorded
from torch import nn

from gradwatch import GradientWatch


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
