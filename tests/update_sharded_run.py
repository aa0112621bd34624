"""Run the update check (``report.scope == "update"``) in plain sharded loops (two processes, CPU, gloo) and write what
each rank saw to JSON.

Usage: ``python tests/update_sharded_run.py OUT_DIR SCENARIO...`` on every rank (``two_processes.run_launched`` sets
the launcher's variables); ``tests/integrations/test_update_sharded.py`` runs it. A scenario is ``<engine>-<kind>``:
``fsdp`` (FSDP2's ``fully_shard`` on every ``Linear`` and the root, ``torch.optim.AdamW``), ``tp`` (tensor parallelism:
``inp`` column-parallel, ``hidden`` row-parallel, ``out`` plain; the ranks on the same batches), ``z1`` / ``z2`` /
``z3`` (DeepSpeed ZeRO stage 1 / 2 / 3, torch's AdamW through ``torch_adam``), trained a few optimizer steps on each
rank's own data, with an applied check (and so an update check) at every step:

- ``healthy`` / ``baseline``: the watch, and the same seeded run without it (parameters and optimizer state digested);
- ``scaled``: an optimizer step post hook (registered before the watch's) that multiplies rank 1's share of each
  parameter's update by 1.1 (FSDP2 and tensor parallelism: each parameter's local shard; ZeRO: its flat fp32
  partitions), at step 3;
- ``own``: an optimizer gradwatch has no rule for, checked by the single-device replay: under ZeRO the one DeepSpeed
  builds for ``"type": "Adagrad"`` (on CPU, torch's ``Adagrad`` stepping DeepSpeed's flat partitions), under FSDP2
  ``torch.optim.Adagrad``; ``fused`` (ZeRO): DeepSpeed's own ``FusedAdam`` (its CPU op, compiled at first use), which
  counts steps per param group; ``fusedscaled``: so, with ``scaled``'s fault.

The ZeRO runs clip the gradient (``gradient_clipping``), which the update check reads from the engine, and, but for
Adagrad, two param groups (ZeRO steps its torch optimizer once per group: the update is compared after the last).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tensor_parallel_run import _digest, _local
from torch import Tensor, nn
from two_processes import leave_without_teardown

from gradwatch import GradientWatch
from gradwatch.engine.results.notes import codes

STEPS = 3
FAULT_STEP = 3  # its update check compares a tensor ZeRO splits between the ranks (hidden.weight)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.hidden = nn.Linear(16, 12)
        self.out = nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.hidden(torch.tanh(self.inp(x)))))


def loss_fn(model: nn.Module, batch: Any) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _data(rank: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(10 + rank)
    return [
        (torch.randn(4, 8, generator=generator), torch.randint(0, 3, (4,), generator=generator)) for _ in range(STEPS)
    ]


def _scale_rank1(optimizer: torch.optim.Optimizer, params: list[Tensor], when: Any) -> None:
    """Step hooks on ``optimizer``: after the step, on rank 1 only, each of ``params`` (local tensors) moved by 1.1
    times its update, at the steps ``when()`` says."""
    kept: dict[int, Tensor] = {}

    def before(*_: Any) -> None:
        if when():
            kept.update({id(p): _local(p).detach().clone() for p in params})

    def after(*_: Any) -> None:
        if kept and torch.distributed.get_rank() == 1:
            with torch.no_grad():
                for p in params:
                    local = _local(p)
                    local.copy_(kept[id(p)] + 1.1 * (local - kept[id(p)]))
        kept.clear()

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


def _report(report: Any) -> dict[str, Any]:
    return {
        "step": report.step, "scope": report.scope, "verdict": report.verdict, "fault": report.fault,
        "message": report.fault_message, "failures": sorted({p.target for p in report.failures}),
        "note_codes": codes(report.notes), "notes": [str(n) for n in report.notes],
    }  # fmt: skip


def _watch() -> GradientWatch:
    return GradientWatch(every_n_steps=100, applied_every_n_steps=1, max_overhead=None, verbose=False)


def _fsdp(kind: str, tensor_parallel: bool = False) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    if tensor_parallel:  # the ranks of the group train on the same batches
        parallelize_module(model, mesh, {"inp": ColwiseParallel(), "hidden": RowwiseParallel()})
    else:
        for layer in (model.inp, model.hidden, model.out):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = (
        torch.optim.Adagrad(model.parameters(), lr=1e-2)
        if kind == "own"
        else torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    )
    step = 0
    if kind == "scaled":
        _scale_rank1(optimizer, list(model.parameters()), lambda: step == FAULT_STEP)
    watch = None if kind == "baseline" else _watch()
    data = _data(0 if tensor_parallel else torch.distributed.get_rank())
    for step in range(1, STEPS + 1):
        batch = data[step - 1]
        if watch is not None:
            watch.record(batch, model=model, step=step)
        loss_fn(model, batch).backward()
        if watch is not None:
            watch.before_optimizer_step(model, loss_fn, step=step, optimizer=optimizer)
        optimizer.step()
        optimizer.zero_grad()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    return {
        "rank": torch.distributed.get_rank(),
        "reports": [_report(r) for r in (watch.reports if watch is not None else [])],
        "params": _digest(list(model.parameters())),
        "optimizer": _digest(state),
    }


def _zero(stage: int, kind: str) -> dict[str, Any]:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    torch.manual_seed(0)
    model = Net()
    optimizer = {
        "type": "AdamW",
        "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": not kind.startswith("fused")},
    }
    if kind.startswith("own"):
        optimizer = {"type": "Adagrad", "params": {"lr": 1e-2}}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        # ZeRO-3: every parameter partitioned, none kept whole for being small
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": optimizer,
        "gradient_clipping": 0.3,
        "steps_per_print": 10**9,
    }
    # two param groups (biases without weight decay): ZeRO steps its torch optimizer once per group (Adagrad: one, as
    # DeepSpeed 0.19.8's ZeRO-1 raises IndexError in its backward over two Adagrad groups, without gradwatch too)
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith("bias")]},
        {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0},
    ]
    engine, *_ = deepspeed.initialize(
        model=model, config=config, model_parameters=model.parameters() if kind.startswith("own") else groups
    )
    step = 0
    inner = engine.optimizer.optimizer  # the torch optimizer stepping the flat fp32 partitions
    # (ZeRO-3 puts each in its param group's params only for its own step)
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if kind.endswith("scaled"):
        _scale_rank1(inner, flats or [p for g in inner.param_groups for p in g["params"]], lambda: step == FAULT_STEP)
    watch = None if kind.endswith("baseline") else _watch()
    data, norms = _data(torch.distributed.get_rank()), []
    for step in range(1, STEPS + 1):
        batch = data[step - 1]
        if watch is not None:
            watch.record(batch)
        engine.backward(loss_fn(engine, batch))
        if watch is not None:
            watch.before_optimizer_step(engine, loss_fn, step=step)
        engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):  # ZeRO-3's partitions gathered (else nothing done)
        digest = _digest([p.detach().clone() for p in params])
    return {
        "rank": torch.distributed.get_rank(),
        "optimizer_class": type(inner).__name__,
        "grad_norms": norms,
        "reports": [_report(r) for r in (watch.reports if watch is not None else [])],
        "params": digest,
        "master": _digest([safe_get_full_fp32_param(p) for p in params]),
        # each rank's partitions of the optimizer state (DeepSpeed 0.19.8 links the state of its first param group
        # only, after that group's first step, so safe_get_full_optimizer_state fails on the others)
        "optimizer": _digest([v for s in inner.state.values() for v in s.values() if isinstance(v, Tensor)]),
    }


def main() -> None:
    out = Path(sys.argv[1])
    for scenario in sys.argv[2:]:
        engine, kind = scenario.split("-")
        result = _fsdp(kind, engine == "tp") if engine in ("fsdp", "tp") else _zero(int(engine.removeprefix("z")), kind)
        (out / f"{scenario}_rank{result['rank']}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    leave_without_teardown()


if __name__ == "__main__":
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    main()
