"""A model split across two ranks by hand (no DTensor, no sharding library: each rank holds its own layer), watched
by ``GradientWatch`` at its defaults in a plain loop, on every rank of a two-process gloo group.

Usage: ``python tests/split_model_run.py OUT_DIR SCENARIO`` on every rank (``two_processes.run_launched``); writes
``rank<r>.json``: each report's scope, step, verdict, fault and note codes, the watch's counts and the warnings.
Scenarios: ``correct`` (each rank's gradient is its layer's), ``halved`` (rank 1's gradient halved by a hook).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gradwatch import GradientWatch


def main(out: Path, scenario: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(10 + rank)  # each rank its own part of the model: other parameters on each rank
    part = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)) if rank == 0 else nn.Sequential(nn.Linear(6, 3))
    if scenario == "halved" and rank == 1:
        part[0].weight.register_hook(lambda grad: grad * 0.5)
    optimizer = torch.optim.SGD(part.parameters(), lr=0.05)
    watch = GradientWatch(every_n_steps=1, applied_every_n_steps=1, max_overhead=None)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, target = batch
        return nn.functional.mse_loss(model(inputs), target)

    generator = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(3):
            batch = (torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator))
            watch.record(batch, model=part, step=step + 1)
            loss_fn(part, batch).backward()
            watch.before_optimizer_step(part, loss_fn, step=step + 1, optimizers=(optimizer,))
            optimizer.step()
            optimizer.zero_grad()
            watch.maybe_check(part, batch, loss_fn, step=step + 1, optimizers=(optimizer,))
    reports = [
        {"scope": r.scope, "step": r.step, "verdict": r.verdict, "fault": r.fault, "notes": [n.code for n in r.notes]}
        for r in watch.reports
    ]
    result = {"reports": reports, "counts": dict(watch.counts), "warnings": [str(w.message) for w in said]}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
