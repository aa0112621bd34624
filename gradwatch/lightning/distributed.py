"""Checks under DDP and FSDP2: under DDP every process checks its own batch shard at the same coordinates; under FSDP2
the processes run one check of the global loss together (:mod:`gradwatch.engine.sharding`). Either way one gather then
gives every process the same report, so that warnings, stops and raises agree across processes
(:mod:`gradwatch.watch.distributed`, which any loop can use)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from gradwatch.engine.report import CheckReport
from gradwatch.watch.distributed import agree_across_ranks


def distributed(trainer: pl.Trainer) -> bool:
    """Whether the trainer runs several processes in an initialised process group."""
    return trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def agree(trainer: pl.Trainer, report: CheckReport | None, error: Exception | None) -> CheckReport | None:
    """Under DDP: every process gets the same report (see :func:`gradwatch.watch.distributed.agree_across_ranks`)."""
    return agree_across_ranks(report, error, trainer.global_step)
