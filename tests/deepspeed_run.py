"""Run gradwatch's checks in plain DeepSpeed ZeRO loops (two processes, CPU, gloo) and write what each rank saw to JSON.

Usage: ``python tests/deepspeed_run.py OUT_DIR SCENARIO...`` on every rank (``two_processes.run_launched`` sets the
launcher's variables); ``tests/integrations/test_deepspeed.py`` runs it. A scenario is ``<kind>-z<stage>-<dtype>``,
each a fresh ``deepspeed.initialize`` of the same seeded MLP (a LayerNorm, a custom ``autograd.Function`` layer whose
weight gradient can be scaled) trained 3 optimizer steps of 2 micro-batches on each rank's own data, with Adam and
gradient clipping, watched by a ``GradientWatch`` as ``docs/deepspeed.md`` says: ``watch.record`` before each
micro-batch, the applied check (``watch.before_optimizer_step`` with ``FullGradients``) at every accumulation boundary
before ``engine.step()``, the recomputed check (``watch.maybe_check``) after steps 1 and 2:

- ``healthy`` / ``baseline``: correct gradients, and the same seeded run without gradwatch;
- ``leftout``: the last micro-batch of the first window left out of the cross-rank reduction (each rank's partition of
  the applied gradient holds its own last micro-batch's gradient instead of the mean over the ranks: DeepSpeed
  PR#7985);
- ``scaled``: rank 1's partition of ``out.weight``'s gradient multiplied by 1.1 after the reduction, first window;
- ``formula``: the custom layer's weight gradient 3% too large on every rank;
- ``hooked``: as ``healthy``, the applied check run by ``before_engine_steps`` inside ``engine.step()`` (where
  Accelerate and the Trainer step), not by the loop;
- ``clipped``: as ``healthy``, and after each ``engine.step()`` the norm the engine clipped with checked against the
  verified gradient's (``watch.after_clipping(..., clipped_with=...)``, :func:`clip_norm`);
- ``clipnorm``: as ``clipped``, the engine's clip norm doubled in the first step (a norm counted twice);
- ``clipnormhooked``: as ``clipnorm``, both checks run inside ``engine.step()`` by ``applied_checks_inside_steps``;
- ``engine``: as ``healthy``, with the calls a new user makes, the engine handed to every one (``watch.record(batch)``,
  ``watch.before_optimizer_step(engine, loss_fn, step=step)``, ``watch.after_clipping(engine, 0.5, step=step)``,
  ``watch.maybe_check(engine, ...)``); ``enginescaled``: so, with ``scaled``'s fault;
- ``module``: the wrapped module handed to ``before_optimizer_step`` without its gradients (under ZeRO-2/3 no
  ``.grad``): the warnings the run gave are written too.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_grad
from real_models import ScaledWeightGradient
from torch import Tensor, nn
from two_processes import leave_without_teardown

from gradwatch import GradientCheckWarning, GradientWatch
from gradwatch.engine.distributed.zero import gathered
from gradwatch.engine.results.notes import codes
from gradwatch.integrations.deepspeed import (
    FullGradients,
    applied_checks_inside_steps,
    before_engine_steps,
    clip_norm,
    full_gradients,
)

# deepspeed.initialize compiles a shared-memory op (g++, minutes) used only by tensor-parallel inference; the attribute
# deepspeed.comm.torch resolves to the torch package, so the module is patched through sys.modules
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]

ACCUMULATE = 2
STEPS = 3


class CustomLinear(nn.Module):
    def __init__(self, inputs: int, outputs: int, factor: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(outputs, inputs) / inputs**0.5)
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return ScaledWeightGradient.apply(x, self.weight, self.factor)


class Net(nn.Module):
    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.custom = CustomLinear(16, 12, factor)
        self.out = nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.custom(self.norm(torch.tanh(self.inp(x))))))


def loss_fn(model: nn.Module, batch: Any) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def _data(rank: int, dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(10 + rank)
    return [
        (torch.randn(4, 8, generator=generator).to(dtype), torch.randint(0, 3, (4,), generator=generator))
        for _ in range(STEPS * ACCUMULATE)
    ]


def _digest(tensors: list[Tensor]) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().float().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _state(engine: Any) -> dict[str, str]:
    """Digests of the module's parameters (gathered under ZeRO-3), the fp32 master parameters and Adam's state."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        module = _digest([p.data.clone() for p in params])
    return {
        "params": module,
        "master": _digest([safe_get_full_fp32_param(p) for p in params]),
        "optimizer": _digest(
            [safe_get_full_optimizer_state(p, key) for p in params for key in ("exp_avg", "exp_avg_sq")]
        ),
    }


def _set_full_grad(param: Tensor, value: Tensor) -> None:
    """``safe_set_full_grad``, with the value padded to whole ZeRO-3 partitions (DeepSpeed 0.19 narrows the flat value
    by the padded partition size)."""
    if hasattr(param, "ds_tensor"):
        padded = torch.zeros(param.ds_tensor.numel() * torch.distributed.get_world_size(), dtype=value.dtype)
        padded[: value.numel()] = value.reshape(-1)
        value = padded
    safe_set_full_grad(param, value)


def _leave_last_micro_batch_out(engine: Any, last: Any, loss: Any = None) -> None:
    """Make each rank's partition of the applied gradient hold its own last micro-batch's gradient (of ``loss``,
    ``loss_fn`` by default) where the mean over the ranks should be: the reduction of that micro-batch left out."""
    loss = loss or loss_fn
    full = full_gradients(engine)
    module = engine.module
    with gathered(module):
        names = [n for n, p in module.named_parameters() if n in full]
        params = [p for n, p in module.named_parameters() if n in full]
        own = torch.autograd.grad(loss(module, last) / ACCUMULATE, params)
    for name, param, mine in zip(names, params, own, strict=True):
        mean = mine.float().clone()
        torch.distributed.all_reduce(mean)
        _set_full_grad(param, full[name] - mean / torch.distributed.get_world_size() + mine.float())


def _scale_rank1_partition(engine: Any) -> None:
    full = full_gradients(engine)
    if torch.distributed.get_rank() == 1:
        _set_full_grad(engine.module.out.weight, full["out.weight"] * 1.1)


def _double_the_clip_norm_once(engine: Any) -> None:
    """The ZeRO optimizer's global gradient norm (the one it clips with) counted twice, in its next step only."""
    optimizer = engine.optimizer
    name = "scaled_global_norm" if hasattr(optimizer, "scaled_global_norm") else "_get_norm_groups"
    own = getattr(optimizer, name)

    def doubled(*args: Any, **kwargs: Any) -> Any:
        del optimizer.__dict__[name]
        found = own(*args, **kwargs)
        return [2 * n for n in found] if isinstance(found, list) else 2 * found

    setattr(optimizer, name, doubled)


def _report(report: Any) -> dict[str, Any]:
    return {
        "step": report.step,
        "scope": report.scope,
        "verdict": report.verdict,
        "fault": report.fault,
        "message": report.fault_message,
        "failures": sorted({p.target for p in report.failures}),
        "culprits": report.culprits,
        "note_codes": codes(report.notes),
        "floor_excess": report.floor_excess,
        "noise_floor": report.noise_floor,
        "duration_s": report.duration_s,
    }


def run(kind: str, stage: int, dtype_name: str) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _train(kind, stage, dtype_name)
    said = [str(w.message) for w in caught if issubclass(w.category, GradientCheckWarning)]
    return {**result, "warnings": said}


def _train(kind: str, stage: int, dtype_name: str) -> dict[str, Any]:
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    torch.manual_seed(0)
    model = Net(1.03 if kind == "formula" else 1.0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": ACCUMULATE,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},  # partitioned for real
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "gradient_clipping": 0.5,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    rank = torch.distributed.get_rank()
    data = _data(rank, dtype)
    watch = None
    if kind != "baseline":  # every rank takes rank 0's decisions (the default): a ZeRO-3 check gathers on all together
        watch = GradientWatch(every_n_steps=2, applied_every_n_steps=1, max_overhead=None, verbose=False)
    hook = None
    if watch is not None and kind == "clipnormhooked":
        hook = applied_checks_inside_steps(engine, watch, loss_fn)
    if watch is not None and kind == "hooked":  # where Accelerate and the Trainer step: inside engine.step()
        hook = before_engine_steps(
            engine,
            lambda: watch.before_optimizer_step(
                engine.module, loss_fn, step=engine.global_steps + 1, gradients=FullGradients(engine)
            ),
        )
    norms, new_user = [], kind.startswith("engine")
    for step in range(1, STEPS + 1):
        for micro in range(ACCUMULATE):
            batch = data[(step - 1) * ACCUMULATE + micro]
            if watch is not None and new_user:
                watch.record(batch)
            elif watch is not None:
                watch.record(batch, model=engine.module, step=step)
            engine.backward(loss_fn(engine, batch))
            boundary = engine.is_gradient_accumulation_boundary()
            if boundary:
                if step == 1 and kind == "leftout":
                    _leave_last_micro_batch_out(engine, batch)
                if step == 1 and kind.endswith("scaled"):
                    _scale_rank1_partition(engine)
                if watch is not None and new_user:
                    watch.before_optimizer_step(engine, loss_fn, step=step)
                elif watch is not None and kind == "module":
                    watch.before_optimizer_step(engine.module, loss_fn, step=step)
                elif watch is not None and hook is None:
                    watch.before_optimizer_step(engine.module, loss_fn, step=step, gradients=FullGradients(engine))
                if step == 1 and kind.startswith("clipnorm"):
                    _double_the_clip_norm_once(engine)
            engine.step()
            if watch is not None and new_user and boundary:
                watch.after_clipping(engine, 0.5, step=step)  # the norm the engine clipped with is read from it
            if watch is not None and hook is None and kind.startswith("clip") and boundary:
                found = clip_norm(engine)
                assert found is not None
                watch.after_clipping(engine.module, found[0], step=step, clipped_with=found[1])
        norms.append(float(engine.get_global_grad_norm()))
        if watch is not None:
            watch.maybe_check(engine if new_user else engine.module, data[(step - 1) * ACCUMULATE], loss_fn, step=step)
    if hook is not None:
        hook.remove()
        assert "step" not in engine.optimizer.__dict__
    return {
        "rank": rank,
        # the gradient checks; the update checks apart
        "reports": [_report(r) for r in (watch.reports if watch is not None else []) if r.scope != "update"],
        "updates": [_report(r) for r in (watch.update_reports if watch is not None else [])],
        "grad_norms": norms,
        **_state(engine),
    }


def main() -> None:
    out = Path(sys.argv[1])
    for scenario in sys.argv[2:]:
        kind, stage, dtype = scenario.split("-")
        result = run(kind, int(stage.removeprefix("z")), dtype)
        (out / f"{scenario}_rank{result['rank']}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    leave_without_teardown()


if __name__ == "__main__":
    main()
