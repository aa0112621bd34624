"""Run GradWatch's applied checks in real two-process FSDP2 fits (Lightning's ``ModelParallelStrategy``, CPU, gloo) and
write what each rank saw to JSON.

Usage: ``python tests/fsdp_applied_run.py OUT_DIR``; ``tests/lightning/test_fsdp_applied.py`` runs it in a subprocess
(the strategy starts rank 1 by running this script again). The model is ``fsdp_run``'s sharded MLP (every ``Linear``
and the root ``fully_shard``-ed, one layer with a single output row so that rank 1's shard of it is empty) with dropout
and a ``tanh`` that can be wrong under autocast only. Scenarios, each a separate ``Trainer.fit`` in the same processes:

- ``healthy`` / ``baseline``: 32-true, an applied check at every optimizer step, and the same seeded run without;
- ``healthy_bf16`` / ``baseline_bf16``: bf16-mixed, two micro-batches a window, gradient clipping;
- ``precision``: the ``tanh``'s backward 1.5x too large under bf16 autocast only (bf16-mixed);
- ``formula``: the custom layer's weight gradient 3% too large on every path;
- ``rank1_corrupted``: rank 1's rows of a gradient changed after the reduce-scatter, at the first step;
- ``both_corrupted``: every rank's rows changed once, at the first step;
- ``raise_on_rank1`` / ``baseline_2_steps``: ``training_step`` raises on rank 1 only during the first applied check
  (neither rank may hang, training goes on as without gradwatch, the next check runs on sound FSDP state);
- ``plain``: no Lightning: the same model ``fully_shard``-ed by hand in a plain loop with ``AppliedWindow``, two
  micro-batches a window, checked at two steps, rank 1's rows of a gradient changed before the second.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from applied_models import AutocastOnlyTanh
from ddp_run import _close_process_group
from fsdp_run import ShardedNet, _digest, _loader, _local
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard

from gradwatch import AppliedWindow, GradWatch
from gradwatch.engine.results.notes import codes


class ShardedDropoutNet(ShardedNet):
    """``fsdp_run``'s sharded MLP with dropout after a ``tanh`` that can be wrong under autocast only."""

    def __init__(self, factor: float = 1.0, autocast_fault: float = 1.0) -> None:
        super().__init__(factor)
        self.dropout = nn.Dropout(0.2)
        self.autocast_fault = autocast_fault

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.dropout(AutocastOnlyTanh.apply(self.inp(x), self.autocast_fault))
        hidden = torch.tanh(self.custom(hidden))
        return self.out(hidden) * torch.sigmoid(self.gate(hidden)) * self.temperature


class CorruptRows(pl.Callback):
    """Placed before GradWatch: at the first optimizer step, multiplies the given ranks' rows of ``inp.weight``'s
    gradient (after FSDP's reduce-scatter) by 1.1."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_rank in self.ranks and trainer.global_step == 0:
            with torch.no_grad():
                _local(pl_module.inp.weight.grad).mul_(1.1)  # type: ignore[union-attr]


class RaiseInFirstCheck(pl.Callback):
    """Placed before GradWatch: makes ``training_step`` raise on rank 1 during the first applied check."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        pl_module.raise_in_step = trainer.global_rank == 1 and trainer.global_step == 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pl_module.raise_in_step = False


def _fit(
    watch: GradWatch | None,
    *extra: pl.Callback,
    factor: float = 1.0,
    autocast_fault: float = 1.0,
    precision: str = "32-true",
    accumulate: int = 1,
    steps: int = 3,
) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = ShardedDropoutNet(factor, autocast_fault)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        precision=precision,  # type: ignore[arg-type]
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=0.5 if accumulate > 1 else None,
        logger=False,
        callbacks=[*extra, watch] if watch is not None else list(extra),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, _loader())
    optimizer = trainer.optimizers[0]
    state = [_local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    every = watch.applied_reports if watch is not None else []
    reports = [r for r in every if "applied-clipping" not in codes(r.notes)]
    return {
        "rank": trainer.global_rank,
        # the clip coefficient Lightning applied (gradient_clip_val), checked against the norm over every shard
        "clipping": [(r.step, r.verdict) for r in every if "applied-clipping" in codes(r.notes)],
        "global_step": trainer.global_step,
        "params": _digest([_local(p) for p in model.parameters()]),
        "optimizer": _digest(state),
        "applied": [
            {
                "step": r.step,
                "verdict": r.verdict,
                "fault": r.fault,
                "message": r.fault_message,
                "failures": sorted({p.target for p in r.failures}),
                "note_codes": codes(r.notes),
                "noise_floor": r.noise_floor,
                "floor_excess": r.floor_excess,
                "evaluations": r.n_forward,
                "backward": r.n_backward,
                "duration_s": r.duration_s,
            }
            for r in reports
        ],
    }


def _plain() -> dict[str, Any]:
    """A plain FSDP2 loop on the process group the fits left (the engine's API, every rank calling it together)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = ShardedDropoutNet()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in (model.inp, model.custom, model.gate, model.out):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = list(_loader())[torch.distributed.get_rank() :: 2]

    def loss_fn(net: nn.Module, batch: Any) -> Tensor:
        return F.cross_entropy(net(batch[0]), batch[1])

    window, reports = AppliedWindow(model), []
    for step in range(2):
        for batch in batches[2 * step : 2 * step + 2]:
            window.record(batch)
            (loss_fn(model, batch) / 2).backward()
        if step == 1 and torch.distributed.get_rank() == 1:
            with torch.no_grad():
                _local(model.out.weight.grad).mul_(1.2)  # type: ignore[union-attr]
        reports.append(window.check(loss_fn, step=step + 1))
        optimizer.step()
        optimizer.zero_grad()
        window.clear()
    return {
        "rank": torch.distributed.get_rank(),
        "applied": [
            {"step": r.step, "verdict": r.verdict, "fault": r.fault, "message": r.fault_message,
             "failures": sorted({p.target for p in r.failures})}
            for r in reports
        ],
    }  # fmt: skip


def _watch() -> GradWatch:
    return GradWatch(applied_every_n_steps=1, every_n_steps=100, max_overhead=None)


def main() -> None:
    out = Path(sys.argv[1])
    bf16: dict[str, Any] = {"precision": "bf16-mixed", "accumulate": 2}
    scenarios = {
        "healthy": lambda: _fit(_watch()),
        "baseline": lambda: _fit(None),
        "healthy_bf16": lambda: _fit(_watch(), **bf16),
        "baseline_bf16": lambda: _fit(None, **bf16),
        "precision": lambda: _fit(_watch(), autocast_fault=1.5, precision="bf16-mixed", steps=1),
        "formula": lambda: _fit(_watch(), factor=1.03, steps=1),
        "rank1_corrupted": lambda: _fit(_watch(), CorruptRows((1,)), steps=2),
        "both_corrupted": lambda: _fit(_watch(), CorruptRows((0, 1)), steps=2),
        "raise_on_rank1": lambda: _fit(_watch(), RaiseInFirstCheck(), steps=2),
        "baseline_2_steps": lambda: _fit(None, steps=2),
        "plain": _plain,
    }
    only = set(sys.argv[2:])
    for name, run in scenarios.items():
        if only and name not in only:
            continue
        result = run()
        (out / f"{name}_rank{result['rank']}.json").write_text(json.dumps(result))
    _close_process_group()


if __name__ == "__main__":
    main()
