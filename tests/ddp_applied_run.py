"""Run GradWatch's applied checks in real two-process DDP fits (CPU, gloo) and write what each rank saw to JSON.

Usage: ``python tests/ddp_applied_run.py OUT_DIR``; ``tests/lightning/test_ddp_applied.py`` runs it in a subprocess.
Scenarios, each a separate ``Trainer.fit`` in the same two processes:

- ``healthy`` / ``baseline``: a classifier with BatchNorm and dropout, with and without applied checks at every step;
- ``comm_hook``: a DDP communication hook that scales the first bucket by 1.5 after averaging (registered on
  ``trainer.strategy.model`` in ``on_fit_start``: Lightning registers ``ddp_comm_hook`` on CUDA only);
- ``rank1_corrupted``: rank 1's reduced gradient is changed after the reduction (a missed synchronisation).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from ddp_run import _close_process_group, _digest
from helpers import LitClassifier, classification_batch, loader
from lightning.pytorch.strategies import DDPStrategy

from gradwatch import GradWatch


def _scale_first_bucket(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses any annotation but its own
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    if bucket.index() == 0:
        buffer.mul_(1.5)
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


class ScaleABucket(pl.Callback):
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.model.register_comm_hook(None, _scale_first_bucket)  # type: ignore[union-attr]


class CorruptRank1(pl.Callback):
    """Placed before GradWatch: changes rank 1's gradient after the reduction, at the first optimizer step."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 0:
            with torch.no_grad():
                next(pl_module.parameters()).grad.mul_(1.01)


def _fit(out: Path, callbacks: list[pl.Callback]) -> tuple[pl.Trainer, LitClassifier]:
    pl.seed_everything(0, verbose=False)
    model = LitClassifier()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=3,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(out),
    )
    trainer.fit(model, loader(classification_batch(), 8))
    return trainer, model


def _watch() -> GradWatch:
    return GradWatch(applied_every_n_steps=1, every_n_steps=100, max_overhead=None)


def run(out: Path, name: str, extra: list[pl.Callback], with_watch: bool = True) -> dict[str, Any]:
    watch = _watch() if with_watch else None
    trainer, model = _fit(out, [*extra, watch] if watch is not None else extra)
    reports = [] if watch is None else watch.applied_reports
    return {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "digest": _digest(model),
        "applied": [
            {"step": r.step, "verdict": r.verdict, "fault": r.fault, "message": r.fault_message} for r in reports
        ],
    }


def main() -> None:
    out = Path(sys.argv[1])
    scenarios = {
        "healthy": lambda: run(out, "healthy", []),
        "baseline": lambda: run(out, "baseline", [], with_watch=False),
        "comm_hook": lambda: run(out, "comm_hook", [ScaleABucket()]),
        "rank1_corrupted": lambda: run(out, "rank1_corrupted", [CorruptRank1()]),
    }
    for name, scenario in scenarios.items():
        result = scenario()
        (out / f"{name}_rank{result['rank']}.json").write_text(json.dumps(result))
    _close_process_group()


if __name__ == "__main__":
    main()
