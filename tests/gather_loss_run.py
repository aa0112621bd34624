"""A contrastive (NT-Xent) loss over embeddings gathered from both ranks with a hand-written ``GatherLayer``, trained
in a plain-PyTorch DDP loop (two processes, CPU, gloo) under a :class:`~gradwatch.GradientWatch` with both kinds of
check at step 1; each rank writes what the checks said to ``OUT_DIR/<scenario>_rank<r>.json``.

Usage: ``torchrun``-style, one process per rank (``tests/watch/test_collective_losses.py`` runs it through
``two_processes.run_launched``): ``python tests/gather_loss_run.py OUT_DIR SCENARIO...``. Each rank draws its own
batch. The layer's forward all-gathers; its backward, by scenario:

- ``correct``: all-reduces the incoming gradients and returns this rank's slot (the gradient of the mean of the
  ranks' losses, once DDP averages);
- ``local_slot``: returns this rank's slot of its own incoming gradient only (lightly #1528, SimCLR copies): the
  other ranks' losses' share of this rank's embeddings is dropped;
- ``all_reduce_none``: returns what ``dist.all_reduce`` returns (``None``): no gradient reaches the encoder at all;
- ``summed_slots``: returns the sum of the slots of every rank (the gradients of other ranks' embeddings added to
  this rank's);
- ``correct_dropout``: the correct layer, with dropout in the encoder (each check replays the random numbers);
- ``raise_on_rank1`` (``tests/gather_loss_lightning_run.py`` only): raises on rank 1, returns the local slot on rank 0.

A learnable temperature after the gather keeps one gradient alive in every scenario (so DDP's reducer and the
applied check have something to hold), as CLIP-style losses have.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from two_processes import serve_scenarios

from gradwatch import GradientWatch


class _Gather(torch.autograd.Function):
    """All-gather of ``x`` along dim 0 in the forward; the backward is the scenario's (class attribute ``mode``)."""

    mode = "correct"

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[Tensor, ...]:
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x.contiguous())
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Tensor | None:
        stacked = torch.stack(grads)
        if _Gather.mode == "correct":
            dist.all_reduce(stacked)
            return stacked[dist.get_rank()]
        if _Gather.mode == "local_slot":
            return grads[dist.get_rank()].clone()
        if _Gather.mode == "all_reduce_none":
            return dist.all_reduce(stacked)  # type: ignore[no-any-return]  # None: the published bug
        if _Gather.mode == "summed_slots":
            return stacked.sum(0)
        if _Gather.mode == "raise_on_rank1":  # after the forward's gathers, on one rank only
            if dist.get_rank() == 1:
                raise RuntimeError("the gather's backward failed on purpose on rank 1")
            return grads[dist.get_rank()].clone()
        raise ValueError(_Gather.mode)


class Contrastive(nn.Module):
    """An encoder of two views and a learnable log-temperature."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 8))
        self.log_temperature = nn.Parameter(torch.tensor(-1.0))

    def forward(self, views: Tensor) -> Tensor:
        return F.normalize(self.encoder(views), dim=-1)


def nt_xent(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """NT-Xent of this rank's pairs against the pairs of every rank (gathered); DDP averages the ranks' gradients."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    a, b = model(batch[0]), model(batch[1])
    za, zb = torch.cat(_Gather.apply(a)), torch.cat(_Gather.apply(b))
    everything = torch.cat([za, zb])
    n, rank = a.shape[0], dist.get_rank()
    local = torch.cat([a, b])
    logits = local @ everything.T / inner.log_temperature.exp()
    total = za.shape[0]
    own = torch.cat([torch.arange(n) + rank * n, torch.arange(n) + rank * n + total])
    logits = logits.masked_fill(F.one_hot(own, 2 * total).bool(), -1e9)  # no pair with itself
    positives = torch.cat([own[n:], own[:n]])
    return F.cross_entropy(logits, positives)


def _train(scenario: str, watched: bool) -> tuple[dict[str, Any], list[float]]:
    """Two optimizer steps, both kinds of check at step 1 when ``watched``: what each check said, the gradient
    norms of step 1 and the parameters after step 2."""
    _Gather.mode = scenario.removesuffix("_dropout")
    torch.manual_seed(0)
    model = DistributedDataParallel(Contrastive(dropout=0.2 if scenario.endswith("_dropout") else 0.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = GradientWatch(every_n_steps=1000, applied_every_n_steps=1000, first_check_step=1, max_overhead=None,
                          verbose=False)  # fmt: skip
    generator = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own data
    said: dict[str, Any] = {"applied": None, "recomputed": None}
    for step in (1, 2):
        x = torch.randn(4, 6, generator=generator)
        batch = (x + 0.1 * torch.randn(4, 6, generator=generator), x + 0.1 * torch.randn(4, 6, generator=generator))
        torch.manual_seed(10 * step + dist.get_rank())  # dropout: each rank its own draws
        optimizer.zero_grad()
        if watched:
            watch.record(batch, model=model, step=step)
        nt_xent(model, batch).backward()
        if step == 1:
            said["grads"] = {n: None if p.grad is None else float(p.grad.norm()) for n, p in model.named_parameters()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            applied = watch.before_optimizer_step(model, nt_xent, step=step) if watched else None
            optimizer.step()
            recomputed = watch.maybe_check(model, batch, nt_xent, step=step) if watched else None
        said["applied"] = said["applied"] or (None if applied is None else _said(applied))
        said["recomputed"] = said["recomputed"] or (None if recomputed is None else _said(recomputed))
    return said, [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]


def run(scenario: str) -> dict[str, Any]:
    started = time.monotonic()
    said, parameters = _train(scenario, watched=True)
    seconds = time.monotonic() - started
    _, unwatched = _train(scenario, watched=False)
    return {"rank": dist.get_rank(), "seconds": seconds, "identical": parameters == unwatched, **said}


def _said(report: Any) -> dict[str, Any]:
    return {
        "verdict": str(report.verdict),
        "fault": report.fault,
        "message": report.fault_message,
        "notes": [str(note) for note in report.notes],
        "report": str(report),
    }


if __name__ == "__main__":
    serve_scenarios(run)
