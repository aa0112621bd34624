"""Run gradwatch's checks on a language-model head split over its vocabulary (2-way tensor parallelism, CPU, gloo) with
a hand-written vocab-parallel cross-entropy, as Megatron-LM writes it, and write what each rank saw to JSON.

Usage: ``python tests/vocab_parallel_run.py OUT_DIR SCENARIO...`` on every rank (``two_processes.run_launched``);
``tests/engine/test_vocab_parallel.py`` runs it. The model embeds tokens and mixes them (replicated parameters), then
a column-parallel head (``ColwiseParallel``: each rank holds the logits of its half of the vocabulary). The loss,
:class:`VocabParallelCrossEntropy`, never gathers the logits: the maximum, the sum of exponentials and the target's
logit are all-reduced over the group in the forward, and the backward is the local ``softmax - one_hot`` from the
saved softmax. Every rank trains on the same batches, 3 optimizer steps, the applied check before each and a
recomputed check after the second. Scenarios:

- ``healthy`` / ``baseline``: the correct cross-entropy, and the same seeded run without gradwatch;
- ``local_softmax``: the backward normalises each rank's exponentials by its own sum instead of the group's (it drops
  the other shard's term of the softmax's denominator): the forward, and so the loss, is right; the gradient is not.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensor_parallel_run import _digest
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from two_processes import serve_scenarios

from gradwatch import AppliedWindow, check_gradients
from gradwatch.engine.results.notes import codes

STEPS = 3
VOCABULARY = 32
_GROUP: Any = None
_LOCAL_SOFTMAX = False


class VocabParallelCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of logits split over the vocabulary across ``_GROUP``'s ranks (rank r holds columns
    ``[r * V/n, (r + 1) * V/n)``), Megatron-LM's ``_VocabParallelCrossEntropy``: the logits are never gathered."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor) -> Tensor:
        rank, width = dist.get_rank(_GROUP), logits.shape[-1]
        start = rank * width
        maximum = logits.detach().max(-1).values
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=_GROUP)
        shifted = logits - maximum.unsqueeze(-1)
        outside = (target < start) | (target >= start + width)
        local_target = (target - start).masked_fill(outside, 0)
        rows = torch.arange(len(target))
        predicted = shifted[rows, local_target].masked_fill(outside, 0.0)
        dist.all_reduce(predicted, group=_GROUP)
        exponentials = shifted.exp()
        local_sum = exponentials.sum(-1)
        total = local_sum.clone()
        dist.all_reduce(total, group=_GROUP)
        denominator = local_sum if _LOCAL_SOFTMAX else total  # the bug: the other shard's term dropped
        ctx.save_for_backward(exponentials / denominator.unsqueeze(-1), outside, local_target)
        return (total.log() - predicted).mean()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        softmax, outside, local_target = ctx.saved_tensors
        rows = torch.arange(len(local_target))
        grad_logits = softmax.clone()
        grad_logits[rows, local_target] -= (~outside).to(softmax.dtype)
        return grad_logits * (grad / len(local_target)), None


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCABULARY, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))  # this rank's columns of the logits


def loss_fn(model: nn.Module, batch: Any) -> Tensor:
    return VocabParallelCrossEntropy.apply(model(batch[0]), batch[1])


def run(kind: str) -> dict[str, Any]:
    global _GROUP, _LOCAL_SOFTMAX
    _LOCAL_SOFTMAX = kind == "local_softmax"
    torch.manual_seed(0)
    model = Model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    _GROUP = mesh.get_group()
    parallelize_module(model, mesh, {"head": ColwiseParallel()})
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    generator = torch.Generator().manual_seed(5)  # the same batches on every rank
    data = [(torch.randint(0, VOCABULARY, (12,), generator=generator),) * 1 for _ in range(STEPS)]
    data = [(tokens, torch.roll(tokens, -1)) for (tokens,) in data]
    watched = not kind.endswith("baseline")
    window = AppliedWindow(model)
    reports = []
    for step, batch in enumerate(data):
        if watched:
            window.record(batch)
        loss_fn(model, batch).backward()
        if watched:
            reports.append(window.check(loss_fn, step=step + 1))
        optimizer.step()
        optimizer.zero_grad()
        window.clear()
        if watched and step == 1:
            reports.append(check_gradients(model, data[0], loss_fn, step=step + 1))
    # the loss is the full-vocabulary cross-entropy: the same as gathering the logits
    with torch.no_grad():
        local = model(data[0][0])
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local.contiguous(), group=_GROUP)
        full = F.cross_entropy(torch.cat(gathered, -1), data[0][1]).item()
        parallel = loss_fn(model, data[0]).item()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    return {
        "rank": dist.get_rank(),
        "losses": [full, parallel],
        "params": _digest(list(model.parameters())),
        "optimizer": _digest(state),
        "reports": [
            {
                "step": r.step,
                "scope": r.scope,
                "verdict": r.verdict,
                "fault": r.fault,
                "failures": sorted({p.target for p in r.failures}),
                "culprits": r.culprits,
                "note_codes": codes(r.notes),
                "summary": r.summary(),
            }
            for r in reports
        ],
    }


if __name__ == "__main__":
    serve_scenarios(run)
