"""The agreement of the processes of a distributed run, through ``torch.distributed`` alone, for every loop.

Under DDP every process checks its own batch shard at the same coordinates; under FSDP2 the processes run one check of
the global loss together (:mod:`gradwatch.engine.distributed`). Either way the processes must take the same decisions:
:func:`rank0_decides` makes rank 0's budget decision everyone's, and :func:`agree_across_ranks` gives every process the
same report, so that warnings, stops and raises agree. Both are what a process group of one (or none) needs too: the
identity. They are the ``decide`` and ``agree`` a :class:`~gradwatch.watch.watch.GradientWatch` takes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gradwatch.engine.distributed.parameters import is_sharded
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import VERDICTS, CheckReport
from gradwatch.errors import RaisedOnAnotherRankError


def world_size() -> int:
    """The processes of the initialised default process group (1 without one)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_world_size())
    return 1


def rank() -> int:
    """This process's rank in the initialised default process group (0 without one)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return 0


def default_group(model: torch.nn.Module) -> Any:
    """The process group whose ranks check an applied gradient together by default: the default group of a run of
    several processes whose parameters are whole on every rank (DDP); ``None`` for one process, and for sharded
    parameters (FSDP2: the engine finds their mesh itself)."""
    if world_size() == 1 or is_sharded(list(model.named_parameters())):
        return None
    return torch.distributed.group.WORLD


def split_ranks(model: torch.nn.Module) -> list[int]:
    """Under a default group of several processes whose parameters are whole (:func:`default_group`), the ranks that
    hold other parameters than rank 0 (a model split across the ranks by hand:
    :func:`~gradwatch.engine.applied.window.ranks_with_other_parameters`); empty otherwise. A collective: every process
    calls it together."""
    group = default_group(model)
    if group is None:
        return []
    from gradwatch.engine.applied.window import ranks_with_other_parameters

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]
    return ranks_with_other_parameters(named, group)


def rank0_decides(wait: int) -> int:
    """Rank 0's budget decision, for every process (they measure different times): 0 to check now, else the steps
    the due check waits."""
    if world_size() == 1:
        return wait
    box: list[Any] = [wait]
    torch.distributed.broadcast_object_list(box, src=0)
    return int(box[0])


def agree_across_ranks(report: CheckReport | None, error: Exception | None, step: int) -> CheckReport | None:
    """Gather every process's outcome of the check at ``step``, so all of them record, log and act on the same report.

    Verdicts may differ between processes. The check's report is the most severe one (fail, then inconclusive, then ok;
    the lowest rank among equals), with a note naming every rank's verdict. If the check raised on any process
    (``on_fail="raise"``), it raises on all."""
    size = world_size()
    if size == 1:
        return report
    local = (report, None if error is None else f"{type(error).__name__}: {error}")
    outcomes: list[Any] = [None] * size
    torch.distributed.all_gather_object(outcomes, local)
    for rank, (_, message) in enumerate(outcomes):
        if message is not None and error is None:
            raise RaisedOnAnotherRankError(
                f"gradwatch: the gradient check at step {step} raised on rank {rank} "
                f"({message}); raising on every process (on_fail='raise')"
            )
    reports = [(rank, r) for rank, (r, _) in enumerate(outcomes) if r is not None]
    if not reports:
        return None
    rank, chosen = max(reports, key=lambda item: (VERDICTS.index(item[1].verdict), -item[0]))
    verdicts = ", ".join(
        f"rank {r}: {outcome[0].verdict if outcome[0] else 'skipped'}" for r, outcome in enumerate(outcomes)
    )
    if any(chosen.noted(code) for code in (NoteCode.SHARDED, NoteCode.LOSS_COLLECTIVES, NoteCode.RANKS_SPLIT)):
        code, words = NoteCode.RANKS_TOGETHER, "one check of the global loss, run together by every process"
    else:
        code, words = NoteCode.RANKS_SHARDS, "checked on every process's own batch shard"
    note = Note(code, f"{words} ({verdicts}); this report is rank {rank}'s")
    return dataclasses.replace(chosen, notes=[*chosen.notes, note])
