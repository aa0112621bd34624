"""Checks under DDP and FSDP2: under DDP every process checks its own batch shard at the same coordinates; under FSDP2
the processes run one check of the global loss together (:mod:`gradwatch.engine.sharding`). Either way one gather then
gives every process the same report, so that warnings, stops and raises agree across processes."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
import torch

from gradwatch.engine.notes import Note, NoteCode
from gradwatch.engine.report import VERDICTS, CheckReport


def distributed(trainer: pl.Trainer) -> bool:
    """Whether the trainer runs several processes in an initialised process group."""
    return trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def agree(trainer: pl.Trainer, report: CheckReport | None, error: Exception | None) -> CheckReport | None:
    """Under DDP: gather every process's outcome, so all of them record, log and act on the same report.

    Each process checked its own shard of the batch at the same coordinates, so verdicts may differ. The check's
    report is the most severe one (fail, then inconclusive, then ok; the lowest rank among equals), with a note
    naming every rank's verdict. If the check raised on any process (``on_fail="raise"``), it raises on all.
    """
    local = (report, None if error is None else f"{type(error).__name__}: {error}")
    outcomes: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(outcomes, local)
    for rank, (_, message) in enumerate(outcomes):
        if message is not None and error is None:
            raise RuntimeError(
                f"gradwatch: the gradient check at step {trainer.global_step} raised on rank {rank} "
                f"({message}); raising on every process (on_fail='raise')"
            )
    reports = [(rank, r) for rank, (r, _) in enumerate(outcomes) if r is not None]
    if not reports:
        return None
    rank, chosen = max(reports, key=lambda item: (VERDICTS.index(item[1].verdict), -item[0]))
    verdicts = ", ".join(
        f"rank {r}: {outcome[0].verdict if outcome[0] else 'skipped'}" for r, outcome in enumerate(outcomes)
    )
    if chosen.noted(NoteCode.SHARDED):
        note = Note(
            NoteCode.RANKS_TOGETHER,
            f"one check of the global loss, run together by every process ({verdicts}); this report is rank {rank}'s",
        )
    else:
        note = Note(
            NoteCode.RANKS_SHARDS,
            f"checked on every process's own batch shard ({verdicts}); this report is rank {rank}'s",
        )
    return dataclasses.replace(chosen, notes=[*chosen.notes, note])
