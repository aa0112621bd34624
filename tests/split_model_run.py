"""Models split across two ranks by hand (no DTensor, no sharding library: each rank holds its own parameters),
trained in a plain loop under ``GradientWatch`` with both kinds of check at every step, on every rank of a two-process
gloo group; each rank writes ``OUT/<scenario>_rank<r>.json``: each report's scope, step, verdict, fault, note codes,
failing targets and message, the warnings, and whether training was bit-identical to a run without the watch.

Usage: ``python tests/split_model_run.py OUT SCENARIO...`` on every rank (``two_processes.run_launched``).
Scenarios:

- ``parts``: each rank its own model (rank 0 a two-layer MLP, rank 1 one linear layer), its own loss, no collective;
- ``tensor_parallel``: a two-layer MLP whose hidden units are split between the ranks (five on rank 0, three on rank
  1; rank 0 holds the output bias), the partial outputs summed by ``torch.distributed.nn``'s autograd all-reduce,
  every rank the same batch and loss (each rank's gradient that of the ranks' summed loss);
- ``megatron``: the same, summed as Megatron does (the all-reduce's backward the identity: each rank's gradient that
  of the one loss every rank computes);

each with ``_halved``: rank 1's first weight gradient halved by a hook (in training and in every recomputation).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import Tensor, nn
from two_processes import serve_scenarios

from gradwatch import GradientWatch

STEPS = 3


class _ReduceFromRegion(torch.autograd.Function):
    """Megatron's ``reduce_from_tensor_model_parallel_region``: all-reduce in the forward, the identity backward (the
    gradient of the one loss every rank computes, not of the ranks' sum)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


class _ColumnRow(nn.Module):
    """This rank's hidden units of a two-layer MLP: ``tanh(x W1ᵀ + b1) W2ᵀ`` all-reduced over the ranks (by
    ``torch.distributed.nn``, or as Megatron does), plus the output bias on rank 0."""

    def __init__(self, hidden: int, *, bias: bool, megatron: bool) -> None:
        super().__init__()
        self.up = nn.Linear(6, hidden)
        self.down = nn.Linear(hidden, 3, bias=bias)
        self.megatron = megatron

    def forward(self, x: Tensor) -> Tensor:
        partial = self.down(torch.tanh(self.up(x)))
        return _ReduceFromRegion.apply(partial) if self.megatron else dist_fn.all_reduce(partial)


def _model(kind: str, rank: int) -> nn.Module:
    torch.manual_seed(10 + rank)  # each rank its own parameters
    if kind == "parts":
        return nn.Sequential(nn.Linear(6, 3)) if rank else nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    return _ColumnRow(5 if rank == 0 else 3, bias=rank == 0, megatron=kind == "megatron")


def _train(kind: str, halved: bool, watched: bool) -> tuple[list[Tensor], GradientWatch | None, list[str]]:
    rank = dist.get_rank()
    model = _model(kind, rank)
    if halved and rank == 1:
        first = model[0] if kind == "parts" else model.up  # type: ignore[index]
        first.weight.register_hook(lambda grad: grad * 0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    watch = GradientWatch(every_n_steps=1, applied_every_n_steps=1, max_overhead=None) if watched else None

    def loss_fn(module: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, target = batch
        return nn.functional.mse_loss(module(inputs), target)

    # tensor parallelism: every rank the same batch; separate parts: each rank its own
    generator = torch.Generator().manual_seed(rank if kind == "parts" else 0)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(1, STEPS + 1):
            batch = (torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator))
            if watch is not None:
                watch.record(batch, model=model, step=step)
            loss_fn(model, batch).backward()
            if watch is not None:
                watch.before_optimizer_step(model, loss_fn, step=step, optimizers=(optimizer,))
            optimizer.step()
            optimizer.zero_grad()
            if watch is not None:
                watch.maybe_check(model, batch, loss_fn, step=step, optimizers=(optimizer,))
    return [p.detach().clone() for p in model.parameters()], watch, [str(w.message) for w in said]


def run(scenario: str) -> dict[str, Any]:
    kind, halved = scenario.removesuffix("_halved"), scenario.endswith("_halved")
    watched, watch, said = _train(kind, halved, watched=True)
    plain, _, _ = _train(kind, halved, watched=False)
    assert watch is not None
    reports = [
        {
            "scope": r.scope, "step": r.step, "verdict": r.verdict, "fault": r.fault,
            "notes": [n.code for n in r.notes], "failing": [p.target for p in r.probes if p.verdict == "fail"],
            "text": str(r),
        }
        for r in watch.reports
    ]  # fmt: skip
    identical = all(torch.equal(a, b) for a, b in zip(watched, plain, strict=True))
    return {"rank": dist.get_rank(), "reports": reports, "warnings": said, "identical": identical,
            "counts": dict(watch.counts)}  # fmt: skip


if __name__ == "__main__":
    serve_scenarios(run)
