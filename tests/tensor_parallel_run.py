"""Run gradwatch's checks in a tensor-parallel loop (``torch.distributed.tensor.parallel``, CPU, gloo) and write what
each rank saw to JSON: two processes on a 1-D mesh ``("tp",)``, or four on a 2-D mesh ``("dp", "tp") = (2, 2)`` with
FSDP2 (``fully_shard``) on the ``"dp"`` dimension over the tensor-parallel plan, as torchtitan composes them.

Usage: ``python tests/tensor_parallel_run.py OUT_DIR SCENARIO...`` on every rank (``two_processes.run_launched``, with
``world=4`` for the 2-D mesh); ``tests/engine/test_tensor_parallel.py`` runs it. The model is a Megatron-style
sequence-parallel block: each rank of a tensor-parallel group normalises its own rows of the batch (scattered as
Megatron scatters) with a replicated ``LayerNorm`` whose weight and bias gradients are summed across the group in the
backward (Megatron's "f": identity forward, all-reduce backward), the rows are gathered, then a column-parallel and a
row-parallel ``Linear`` (``ColwiseParallel``, ``RowwiseParallel``: ``DTensor`` parameters).
The ranks of a tensor-parallel group train on the same batches (each data-parallel rank on its own), 3 optimizer
steps, Adam, the applied check before every step and a recomputed check after the second. Scenarios:

- ``healthy`` / ``baseline``: correct gradients, and the same seeded run without gradwatch;
- ``unreduced``: the plan leaves the norm's weight and bias out of the backward's all-reduce (each rank keeps the
  gradient of its own rows: Megatron #7452);
- ``unreduced_rank1``: the same on rank 1 only (it takes part in the all-reduce and keeps its own gradient);
- ``twice``: the loop all-reduces the norm weight's gradient once more over the tensor-parallel group after the
  backward (a doubled reduction);
- ``formula``: the weight gradient of the replicated gate after the row-parallel layer 3% too large on every rank;
- ``hsdp`` / ``hsdp_baseline`` (four processes): no tensor parallelism, FSDP2's hybrid sharding on a 2-D mesh
  ``("replicate", "shard") = (2, 2)``, every rank its own batch; and the same without gradwatch;
- ``hsdp_scaled``: the same, rank 1's shard of ``fc2.weight``'s gradient multiplied by 1.1 after the reduction (first
  step).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from two_processes import serve_scenarios

from gradwatch import AppliedWindow, check_gradients
from gradwatch.engine.results.notes import codes

STEPS = 3
_TP: Any = None  # the tensor-parallel process group of this run


class ReducedInBackward(torch.autograd.Function):
    """The identity, whose gradient is summed across the ranks (Megatron's "f" for sequence-parallel parameters)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, keep_own: bool) -> Tensor:
        ctx.keep_own = keep_own
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        summed = grad.clone()
        dist.all_reduce(summed, group=_TP)
        return (grad if ctx.keep_own else summed), None


class ScatterRows(torch.autograd.Function):
    """This rank's rows of a replicated tensor; the gradient is every rank's rows gathered (Megatron's scatter to the
    sequence-parallel region)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        return tensor.chunk(dist.get_world_size(_TP))[dist.get_rank(_TP)].clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        gathered = torch.empty((grad.shape[0] * dist.get_world_size(_TP), *grad.shape[1:]), dtype=grad.dtype)
        dist.all_gather_into_tensor(gathered, grad.contiguous(), group=_TP)
        return gathered


class GatherRows(torch.autograd.Function):
    """Every rank's rows, in rank order; the gradient of this rank's rows is its slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor) -> Tensor:
        gathered = torch.empty((rows.shape[0] * dist.get_world_size(_TP), *rows.shape[1:]), dtype=rows.dtype)
        dist.all_gather_into_tensor(gathered, rows.contiguous(), group=_TP)
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.chunk(dist.get_world_size(_TP))[dist.get_rank(_TP)].contiguous()


class ScaledGate(torch.autograd.Function):
    """``x * weight``, with a hand-written backward whose weight gradient is multiplied by ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, factor: float) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.factor = factor
        return x * weight

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight = ctx.saved_tensors
        return grad * weight, (grad * x).sum(0) * ctx.factor, None


class Gate(nn.Module):
    def __init__(self, features: int, factor: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + torch.randn(features) / 4)
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return ScaledGate.apply(x, self.weight, self.factor)


class SequenceParallelNet(nn.Module):
    def __init__(self, reduce_norm: bool = True, keep_own: bool = False, factor: float = 1.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.gate = Gate(4, factor)  # replicated, after the row-parallel layer's (replicated) output
        self.reduce_norm, self.keep_own = reduce_norm, keep_own

    def forward(self, x: Tensor) -> Tensor:
        rows = ScatterRows.apply(x)
        weight, bias = self.norm.weight, self.norm.bias
        if self.reduce_norm:
            weight, bias = ReducedInBackward.apply(weight, self.keep_own), ReducedInBackward.apply(bias, self.keep_own)
        hidden = GatherRows.apply(F.layer_norm(rows, (8,), weight, bias))
        return self.gate(self.fc2(torch.tanh(self.fc1(hidden))))


def loss_fn(model: nn.Module, batch: Any) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _digest(tensors: list[Tensor]) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(_local(tensor).detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run(kind: str) -> dict[str, Any]:
    global _TP
    torch.manual_seed(0)
    keep_own = kind == "unreduced_rank1" and dist.get_rank() == 1
    model = SequenceParallelNet(
        reduce_norm=kind != "unreduced", keep_own=keep_own, factor=1.03 if kind == "formula" else 1
    )
    world = dist.get_world_size()
    if kind.startswith("hsdp"):  # no tensor parallelism: groups of one rank, every rank its own batch
        _TP = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))["tp"].get_group()
        fully_shard(model, mesh=init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")))
        dp_rank = dist.get_rank()
    elif world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        _TP, dp_rank = mesh["tp"].get_group(), mesh["dp"].get_local_rank()
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        _TP, dp_rank = tp_mesh.get_group(), 0
        parallelize_module(model, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    generator = torch.Generator().manual_seed(5 + dp_rank)  # the same batches on every rank of a tensor-parallel group
    data = [(torch.randn(8, 8, generator=generator), torch.randint(0, 4, (8,), generator=generator)) for _ in range(3)]
    watched = not kind.endswith("baseline")
    window = AppliedWindow(model)
    reports = []
    for step, batch in enumerate(data[:STEPS]):
        if watched:
            window.record(batch)
        loss_fn(model, batch).backward()
        if kind == "twice" and step == 0:
            dist.all_reduce(_local(model.norm.weight.grad), group=_TP)  # type: ignore[arg-type]
        if kind == "hsdp_scaled" and step == 0 and dist.get_rank() == 1:
            _local(model.fc2.weight.grad).mul_(1.1)  # type: ignore[arg-type]
        if watched:
            reports.append(window.check(loss_fn, step=step + 1))
        optimizer.step()
        optimizer.zero_grad()
        window.clear()
        if watched and step == 1:
            reports.append(check_gradients(model, data[0], loss_fn, step=step + 1))
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    return {
        "rank": dist.get_rank(),
        "dtensors": sorted(n for n, p in model.named_parameters() if hasattr(p, "to_local")),
        "params": _digest(list(model.parameters())),
        "optimizer": _digest(state),
        "reports": [
            {
                "step": r.step,
                "scope": r.scope,
                "verdict": r.verdict,
                "fault": r.fault,
                "message": r.fault_message,
                "failures": sorted({p.target for p in r.failures}),
                "culprits": r.culprits,
                "note_codes": codes(r.notes),
                "floor_excess": r.floor_excess,
                "duration_s": r.duration_s,
            }
            for r in reports
        ],
    }


if __name__ == "__main__":
    serve_scenarios(run)
