"""The cost of one applied check in training steps, per parallel engine: DeepSpeed ZeRO 1-3 (fp32, bf16) and tensor
parallelism (2 processes, CPU, gloo), and tensor parallelism with FSDP2 on a second mesh dimension (4 processes, a
``("dp", "tp") = (2, 2)`` mesh).

Usage: ``python benchmarks/parallel_engines.py [--steps N]`` (a few minutes). Each engine trains the same seeded MLP
(64 → 256 → LayerNorm → 256 → 10, about 86k parameters; under tensor parallelism the last two ``Linear`` layers
column- and row-parallel, with FSDP2 the whole model sharded over ``"dp"`` on top) for ``--steps`` optimizer steps of
2 micro-batches of 32 samples (per data-parallel rank), with the applied check of
``gradwatch`` at every other accumulation boundary (DeepSpeed: ``safe_get_full_grad`` gathered by
``gradwatch.integrations.deepspeed.full_gradients``, under ZeRO-3 the parameters gathered for the check). Prints a
markdown table: per engine, the median training step without a check, the median applied check (the gradients'
gathering included), their ratio (the cost of one check in training steps), and the verdicts.
"""

from __future__ import annotations

import argparse
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
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gradwatch.engine.applied import AppliedWindow

ENGINES = ("ZeRO-1 fp32", "ZeRO-2 fp32", "ZeRO-3 fp32", "ZeRO-1 bf16", "ZeRO-2 bf16", "ZeRO-3 bf16", "tensor parallel")
FOUR_PROCESS_ENGINES = ("tensor parallel + FSDP2",)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 256)
        self.norm = nn.LayerNorm(256)
        self.hidden = nn.Linear(256, 256)
        self.out = nn.Linear(256, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.hidden(self.norm(torch.tanh(self.inp(x))))))


def loss_fn(model: nn.Module, batch: Any) -> Tensor:
    return F.cross_entropy(model(batch[0]).float(), batch[1])


def _batches(count: int, dtype: torch.dtype, seed: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 64, generator=generator).to(dtype), torch.randint(0, 10, (32,), generator=generator))
            for _ in range(count)]  # fmt: skip


def _deepspeed(engine_name: str, steps: int) -> tuple[list[float], list[float], list[str]]:
    import deepspeed

    from gradwatch.integrations.deepspeed import full_gradients

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    stage = int(engine_name[5])
    dtype = torch.bfloat16 if "bf16" in engine_name else torch.float32
    torch.manual_seed(0)
    model = MLP()
    config = {
        "train_micro_batch_size_per_gpu": 32,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    data = _batches(2 * steps, dtype, seed=dist.get_rank())
    window = AppliedWindow(engine.module)
    train, check, verdicts = [], [], []
    for step in range(steps):
        checked = step % 2 == 1
        started, spent = time.perf_counter(), 0.0
        for micro in range(2):
            batch = data[2 * step + micro]
            if checked:
                window.record(batch)
            engine.backward(loss_fn(engine, batch))
            if checked and engine.is_gradient_accumulation_boundary():
                before = time.perf_counter()
                report = window.check(loss_fn, gradients=full_gradients(engine), step=step + 1)
                spent = time.perf_counter() - before
                check.append(spent)
                verdicts.append(report.verdict)
            engine.step()
        window.clear()
        if not checked:
            train.append(time.perf_counter() - started - spent)
    return train, check, verdicts


def _tensor_parallel(steps: int, fsdp: bool = False) -> tuple[list[float], list[float], list[str]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = MLP()
    if fsdp:
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
        tp_mesh, seed = mesh["tp"], mesh["dp"].get_local_rank()
    else:
        tp_mesh, seed = init_device_mesh("cpu", (dist.get_world_size(),)), 0
    parallelize_module(model, tp_mesh, {"hidden": ColwiseParallel(), "out": RowwiseParallel()})
    if fsdp:
        fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    data = _batches(2 * steps, torch.float32, seed=seed)  # a tensor-parallel group shares its batches
    window = AppliedWindow(model)
    train, check, verdicts = [], [], []
    for step in range(steps):
        checked = step % 2 == 1
        started = time.perf_counter()
        for micro in range(2):
            batch = data[2 * step + micro]
            if checked:
                window.record(batch)
            (loss_fn(model, batch) / 2).backward()
        if checked:
            before = time.perf_counter()
            verdicts.append(window.check(loss_fn, step=step + 1).verdict)
            check.append(time.perf_counter() - before)
        optimizer.step()
        optimizer.zero_grad()
        window.clear()
        if not checked:
            train.append(time.perf_counter() - started)
    return train, check, verdicts


def _measure(name: str, steps: int) -> tuple[list[float], list[float], list[str]]:
    if name.startswith("tensor parallel"):
        return _tensor_parallel(steps, fsdp=name.endswith("FSDP2"))
    return _deepspeed(name, steps)


def _worker(rank: int, world: int, port: int, steps: int, queue: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for name in ENGINES if world == 2 else FOUR_PROCESS_ENGINES:
        train, check, verdicts = _measure(name, steps)
        if rank == 0:
            queue.put((name, statistics.median(train), statistics.median(check), Counter(verdicts)))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per engine (a check every other)")
    parser.add_argument("--only", choices=("2", "4"), help="only the engines of 2 (or 4) processes")
    arguments = parser.parse_args()
    context = mp.get_context("spawn")
    queue = context.Queue()
    for world in (2, 4):
        if arguments.only not in (None, str(world)):
            continue
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        mp.start_processes(_worker, args=(world, port, arguments.steps, queue), nprocs=world, start_method="spawn")
    print("| engine | training step (ms) | applied check (ms) | check in training steps | verdicts |")
    print("|---|---|---|---|---|")
    while not queue.empty():
        name, train, check, verdicts = queue.get()
        listed = ", ".join(f"{count} {verdict}" for verdict, count in sorted(verdicts.items()))
        print(f"| {name} | {1e3 * train:.1f} | {1e3 * check:.1f} | {check / train:.1f} | {listed} |")


if __name__ == "__main__":
    main()
