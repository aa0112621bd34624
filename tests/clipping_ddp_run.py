"""Clip a DDP model's reduced gradient in two processes (CPU, gloo), rightly and with a norm over one rank's partition
only, and write what :func:`check_clipping` said on each rank to ``OUT_DIR/<scenario>_rank<r>.json``.

Usage: ``python tests/clipping_ddp_run.py OUT_DIR``; ``tests/engine/test_clipping.py`` runs it in a subprocess.
Scenarios: ``correct`` (``clip_grad_norm_`` over the whole reduced gradient, as every rank holds it under DDP) and
``one_rank`` (a ZeRO-like loop in which each rank owns half the tensors and takes the norm over its own half without
summing the squares over the ranks, then clips every tensor by the coefficient that gives).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradwatch.engine.applied.clipping import GradientNorms, check_clipping

MAX_NORM = 0.05


def _one_rank_clip(params: list[nn.Parameter], rank: int, world: int) -> None:
    owned = [p for i, p in enumerate(params) if i % world == rank]
    local = math.sqrt(sum(float(p.grad.double().square().sum()) for p in owned))  # type: ignore[union-attr]
    coefficient = min(1.0, MAX_NORM / (local + 1e-6))  # the squares of the other ranks' tensors never summed in
    for p in params:
        p.grad.mul_(coefficient)  # type: ignore[union-attr]


def _run(rank: int, world: int, out: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))
        params = list(model.parameters())
        generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        for scenario in ("correct", "one_rank"):
            model.zero_grad()
            x, y = torch.randn(32, 6, generator=generator), torch.randint(0, 3, (32,), generator=generator)
            nn.functional.cross_entropy(model(x), y).backward()  # DDP averages over the ranks
            verified = GradientNorms.of([p.grad for p in params])
            if scenario == "correct":
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            else:
                _one_rank_clip(params, rank, world)
            report = check_clipping(verified, [p.grad for p in params], MAX_NORM)
            record = {"verdict": str(report.verdict), "fault": report.fault, "message": report.fault_message,
                      "notes": [str(n) for n in report.notes], "total": verified.total}  # fmt: skip
            Path(out, f"{scenario}_rank{rank}.json").write_text(json.dumps(record))
        dist.barrier()  # both ranks done before either tears gloo down (a rank torn down first aborted the other)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    out_dir, port = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "29533"
    mp.spawn(_run, args=(2, out_dir, port), nprocs=2, join=True)
