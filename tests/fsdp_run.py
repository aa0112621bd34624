"""Run GradWatch in real two-process FSDP2 fits (Lightning's ``ModelParallelStrategy``, CPU, gloo) and write what each
rank saw to JSON.

Usage: ``python tests/fsdp_run.py OUT_DIR``. The strategy starts rank 1 by running this script again, so it cannot run
inside pytest; ``tests/lightning/test_fsdp.py`` runs it in a subprocess with a timeout and asserts on
``OUT_DIR/<scenario>_rank<r>.json``. Every scenario is a separate ``Trainer.fit`` in the same two processes, on an MLP
whose every ``Linear`` and the root (which holds a parameter of its own) are ``fully_shard``-ed (one layer has a single
output row: rank 1's shard of it is empty), with a custom ``autograd.Function`` layer whose weight gradient can be
scaled:

- ``healthy``: correct gradients, Adam, checks every 2 steps;
- ``baseline``: the same seeded run without gradwatch (for bit-identical parameters and optimizer state);
- ``bug``: the custom layer's weight gradient 3% too large on every rank;
- ``raise_on_rank1``: ``training_step`` raises on rank 1 only, during the checks.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from real_models import ScaledWeightGradient
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from gradwatch import GradWatch
from gradwatch.engine.results.notes import codes


class CustomLinear(nn.Module):
    def __init__(self, inputs: int, outputs: int, factor: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(outputs, inputs) / inputs**0.5)
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast("cpu", enabled=False):  # run in float32 under autocast too, as custom kernels often are
            return ScaledWeightGradient.apply(x.float(), self.weight, self.factor)


class ShardedNet(pl.LightningModule):
    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.custom = CustomLinear(16, 12, factor)
        self.gate = nn.Linear(12, 1)  # one row: rank 1 holds an empty shard of its weight
        self.out = nn.Linear(12, 3)
        self.temperature = nn.Parameter(torch.ones(3))  # the root's own: FSDP keeps it gathered after forward
        self.raise_in_step = False

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.inp, self.custom, self.gate, self.out):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: Tensor) -> Tensor:
        hidden = torch.tanh(self.custom(torch.tanh(self.inp(x))))
        return self.out(hidden) * torch.sigmoid(self.gate(hidden)) * self.temperature

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.raise_in_step:
            raise RuntimeError("raised in training_step on rank 1 only")
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class RaiseInCheck(pl.Callback):
    """Makes ``training_step`` raise during the check, on rank 1 only (set just before GradWatch's hook)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pl_module.raise_in_step = trainer.global_rank == 1


class StepTimer(pl.Callback):
    """The wall time of each training step (forward, backward, optimizer step), without the check after it."""

    def __init__(self) -> None:
        self.started = 0.0
        self.times: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self.started)


class StopRaising(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pl_module.raise_in_step = False


def _digest(tensors: list[Tensor]) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _local(tensor: Any) -> Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(128, 8, generator=generator), torch.randint(0, 3, (128,), generator=generator))
    return DataLoader(data, batch_size=8)


def _fit(factor: float, watch: GradWatch | None, *extra: pl.Callback, max_steps: int = 6) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = ShardedNet(factor)
    timer = StepTimer()
    callbacks = [timer, *extra, watch] if watch is not None else [timer, *extra]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=max_steps,
        logger=False,
        callbacks=[*callbacks, StopRaising()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, _loader())
    optimizer = trainer.optimizers[0]
    state = [_local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    reports = [
        {
            "step": r.step,
            "verdict": r.verdict,
            "probes": [[p.kind, p.target, p.index and list(p.index), p.verdict] for p in r.probes],
            "failures": [p.target for p in r.failures],
            "notes": r.notes,
            "note_codes": codes(r.notes),
            "duration_s": r.duration_s,
        }
        for r in (watch.recomputed_reports if watch is not None else [])
    ]
    return {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "finished": trainer.state.finished,
        "sharded": all(type(p).__name__ == "DTensor" for p in model.parameters()),
        "reports": reports,
        "counts": watch.counts if watch is not None else None,
        "params": _digest([_local(p) for p in model.parameters()]),
        "optimizer": _digest(state),
        "step_s": statistics.median(timer.times[1:]),
    }


def main() -> None:
    out = Path(sys.argv[1])
    scenarios = {
        "healthy": lambda: _fit(1.0, GradWatch(every_n_steps=2, max_overhead=None)),
        "baseline": lambda: _fit(1.0, None),
        "bug": lambda: _fit(1.03, GradWatch(every_n_steps=2, max_overhead=None)),
        "raise_on_rank1": lambda: _fit(1.0, GradWatch(every_n_steps=1, max_overhead=None), RaiseInCheck(), max_steps=3),
    }
    for name, run in scenarios.items():
        result = run()
        (out / f"{name}_rank{result['rank']}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
