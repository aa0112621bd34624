"""A training run under a ``GradientWatch`` that stops at the first check with a given verdict: the detection-latency
tests and benchmarks (deep Llama, diffusers UNet) count the checks until a planted bug is found."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch import CheckReport, GradientWatch


def first_check_with(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[nn.Module, Any], Tensor],
    *,
    lr: float,
    checks: int,
    stop: Collection[str] = ("fail",),
) -> tuple[int | None, CheckReport | None, list[int]]:
    """Train ``model`` with AdamW on ``batches`` under ``GradientWatch(every_n_steps=2)`` until a check's verdict is in
    ``stop`` or ``checks`` checks were made: that check's position (1 for the first) and report (``None, None`` when
    none stopped the run), and the loss evaluations of every check before it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    watch = GradientWatch(every_n_steps=2, max_overhead=None, verbose=False)
    passed: list[int] = []
    made = 0
    for step, batch in enumerate(batches, 1):
        optimizer.zero_grad()
        loss_fn(model, batch).backward()
        optimizer.step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = watch.maybe_check(model, batch, loss_fn, step=step)
        if report is None:
            continue
        made += 1
        if report.verdict in stop:
            return made, report, passed
        passed.append(report.n_forward)
        if made >= checks:
            break
    return None, None, passed
