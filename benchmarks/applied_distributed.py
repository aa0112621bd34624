"""The applied-gradient check across ranks (2 processes, CPU, gloo): a healthy sweep under FSDP2 and DDP, and the cost.

Usage: ``python benchmarks/applied_distributed.py [--seeds N] [--strategy fsdp2 ddp]`` (CPU, a few minutes). Two
processes each build the same seeded model, shard it (FSDP2's ``fully_shard`` on every transformer block, or every
child module holding parameters, then the root) or wrap it in ``DistributedDataParallel``, train one accumulation
window of two micro-batches on their own synthetic data (32-true, or under bf16 autocast) and check the applied
gradient together (under DDP with ``group=``, each rank's gradient reduced by DDP's all-reduce).

Prints a markdown table per strategy: per model and precision, the verdicts, the measured noise floor along the
applied gradient relative to ``‖g‖`` (median), the largest discrepancy of a healthy check in units of its tolerance (a
failure needs more than 1), and the check's time against the window's training.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from applied import _language_model, _lm_loss
from applied_models import CNN, MLP, Transformer, batch_for, bf16, cross_entropy

from gradwatch.engine.applied import AppliedWindow

MODELS: dict[str, Any] = {
    "MLP (dropout)": MLP,
    "CNN (BatchNorm, dropout)": CNN,
    "transformer (dropout)": Transformer,
    "tiny HF Llama": lambda: _language_model("tiny Llama"),
    "tiny HF GPT-2": lambda: _language_model("tiny GPT-2"),
}
PATHS: dict[str, Any] = {"32-true": None, "bf16-mixed": bf16}


def _shard(model: nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    blocks = getattr(getattr(model, "model", None), "layers", None) or getattr(
        getattr(model, "transformer", None), "h", None
    )
    holders = [m for m in model.children() if next(m.parameters(), None) is not None]
    units = list(blocks) if blocks is not None else holders
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _window(name: str, seed: int, path: Any, strategy: str) -> tuple[AppliedWindow, Any, float]:
    torch.manual_seed(seed)  # the same initial model on every rank
    model = MODELS[name]()
    rank = dist.get_rank()
    language = "HF" in name
    if language:
        generator = torch.Generator().manual_seed(100 * seed + rank)
        batches: list[Any] = [torch.randint(0, 64, (4, 16), generator=generator) for _ in range(2)]
        loss_fn: Any = _lm_loss
    else:
        batches = [batch_for(model, seed=100 * seed + 10 * rank + s) for s in (1, 2)]
        loss_fn = cross_entropy
    trained: nn.Module = model
    if strategy == "fsdp2":
        _shard(model)  # after batch_for, which reads the model's class (fully_shard changes it)
    else:  # training goes through DDP's all-reduce; the check evaluates the module inside, as Lightning's does
        trained = nn.parallel.DistributedDataParallel(model)
    window = AppliedWindow(model)
    started = time.perf_counter()
    for batch in batches:
        window.record(batch)
        with path() if path is not None else contextlib.nullcontext():
            loss = loss_fn(trained, batch)
        (loss / len(batches)).backward()
    return window, loss_fn, time.perf_counter() - started


def _worker(rank: int, port: int, seeds: int, strategy: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    rows = []
    for name in MODELS:
        for precision, path in PATHS.items():
            verdicts: Counter[str] = Counter()
            floors, excess, ratios = [], [], []
            for seed in range(seeds):
                window, loss_fn, train_s = _window(name, seed, path, strategy)
                group = dist.group.WORLD if strategy == "ddp" else None
                report = window.check(loss_fn, path=path, group=group)
                verdicts[report.verdict] += 1
                if report.verdict != "ok" and rank == 0:
                    print(report, file=sys.stderr)
                floors.append(report.noise_floor)
                excess.append(report.floor_excess)
                ratios.append(report.duration_s / train_s)
            verdict = ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items()))
            rows.append(
                f"| {name} | {precision} | {verdict} | {statistics.median(floors):.2e} | {max(excess):.2f} "
                f"| {statistics.median(ratios):.0f} |"
            )
    if rank == 0:
        print(f"{strategy}, 2 processes:\n")
        print("| model | precision | verdicts | floor / ‖g‖ median | worst healthy excess | check / window |")
        print("|---|---|---|---|---|---|")
        print("\n".join(rows) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--strategy", nargs="+", choices=["fsdp2", "ddp"], default=["fsdp2", "ddp"])
    options = parser.parse_args()
    for strategy in options.strategy:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        mp.spawn(_worker, args=(port, options.seeds, strategy), nprocs=2)


if __name__ == "__main__":
    main()
