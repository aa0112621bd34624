"""Run ``GradWatchCallback`` in ``transformers.Trainer(deepspeed=...)`` fits, and the applied check in Accelerate loops
on DeepSpeed (ZeRO 1-3, two processes, CPU, gloo), and write what each rank saw to JSON.

Usage: ``python tests/deepspeed_trainer_run.py OUT_DIR SCENARIO...`` on every rank (``two_processes.run_launched``);
``tests/integrations/test_deepspeed_trainer.py`` runs it. A scenario is ``<kind>-z<stage>-<fp32|bf16>``: ``healthy`` (a
check at every optimizer step), ``baseline`` (the same seeded fit without the callback) or ``formula`` (the custom
layer's weight gradient 3% too large), each 3 optimizer steps of 2 micro-batches with gradient clipping, on
``deepspeed_run``'s MLP. Kinds ``accelerate``, ``accelerate_baseline`` and ``accelerate_formula`` are a plain
Accelerate loop instead (``accelerator.backward`` steps the engine) watched by a ``GradientWatch``: the applied check
run at the engine's accumulation boundary by ``applied_checks_inside_steps``, recomputed checks after steps 1 and 2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.nn.functional as F
import transformers
from accelerate import PartialState
from accelerate.state import AcceleratorState
from deepspeed.utils import safe_get_full_fp32_param
from deepspeed_run import Net, _digest, _leave_last_micro_batch_out, _scale_rank1_partition
from torch import Tensor
from torch.utils.data import Dataset
from two_processes import leave_without_teardown

from gradwatch import GradientWatch
from gradwatch.engine.results.notes import codes
from gradwatch.integrations.deepspeed import applied_checks_inside_steps, before_engine_steps
from gradwatch.integrations.huggingface import GradWatchCallback

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]  # see deepspeed_run


class Classifier(Net):
    def forward(self, x: Tensor, labels: Tensor | None = None) -> dict[str, Tensor]:  # type: ignore[override]
        logits = super().forward(x.to(self.inp.weight.dtype))  # bf16 under DeepSpeed's bf16
        return {"logits": logits, **({} if labels is None else {"loss": F.cross_entropy(logits.float(), labels)})}


class Points(Dataset):
    def __init__(self, rank: int) -> None:
        generator = torch.Generator().manual_seed(20 + rank)
        self.x = torch.randn(64, 8, generator=generator)
        self.y = torch.randint(0, 3, (64,), generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"x": self.x[index], "labels": self.y[index]}


class AppliedChecks(transformers.TrainerCallback):
    """The applied check of a ``Trainer(deepspeed=...)`` run until ``GradWatchCallback`` makes it: every micro-batch
    recorded where the Trainer computes its loss, the check run inside the engine's step by
    ``applied_checks_inside_steps``; ``plant`` runs just before it (a fault planted after the reduction)."""

    def __init__(self, trainer: transformers.Trainer, plant: Any = None) -> None:
        self.trainer, self.plant = trainer, plant
        # every rank takes rank 0's decisions and acts on one report: the watch's defaults
        self.watch = GradientWatch(every_n_steps=10**6, applied_every_n_steps=1, max_overhead=None, verbose=False)
        self.hooks: list[Any] = []
        self.last: dict[str, Tensor] = {}  # the last micro-batch the Trainer trained on

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer, engine = self.trainer, self.trainer.model_wrapped
        compute_loss = trainer.compute_loss

        def loss_fn(model: Any, inputs: Any) -> Tensor:
            return compute_loss(model, dict(inputs))

        def recording(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if model.training:
                self.last = dict(inputs)
                self.watch.record(dict(inputs), model=engine.module, step=engine.global_steps + 1)
            return compute_loss(model, inputs, *args, **kwargs)

        trainer.compute_loss = recording  # type: ignore[method-assign]
        self.hooks = [applied_checks_inside_steps(engine, self.watch, loss_fn)]
        if self.plant is not None:  # installed last, runs first: after the reduction, before the check
            self.hooks.append(before_engine_steps(engine, lambda: self.plant(engine, self)))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for hook in reversed(self.hooks):
            hook.remove()
        del self.trainer.compute_loss


def _plant_once(fault: Any) -> Any:
    def plant(engine: Any, callback: AppliedChecks) -> None:
        if engine.global_steps == 0:
            fault(engine, callback)

    return plant


def _leftout(engine: Any, callback: AppliedChecks) -> None:
    def loss(model: Any, inputs: Any) -> Tensor:
        return model(**inputs)["loss"]

    _leave_last_micro_batch_out(engine, callback.last, loss)


def run(kind: str, stage: int, bf16: bool, out: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Classifier(1.03 if kind == "formula" else 1.0)
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": "auto"},
        "steps_per_print": 10**9,
    }
    args = transformers.TrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=3,
        max_grad_norm=0.5,
        learning_rate=1e-2,
        deepspeed=config,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        bf16=bf16,
        accelerator_config={"use_configured_state": True},
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Points(torch.distributed.get_rank()))
    callback: Any = None
    if kind in ("healthy", "formula"):
        callback = GradWatchCallback(trainer, every_n_steps=1, max_overhead=None, verbose=False)
    elif kind == "applied":  # the callback's own applied checks, inside the engine's step
        callback = GradWatchCallback(trainer, every_n_steps=10**6, first_check_step=None, applied_every_n_steps=1,
                                     max_overhead=None, verbose=False)  # fmt: skip
    elif kind.startswith("applied"):  # a fault planted after the reduction, just before the check
        faults = {
            "applied_leftout": _leftout,
            "applied_scaled": lambda e, w: _scale_rank1_partition(e),
        }
        callback = AppliedChecks(trainer, _plant_once(faults[kind]))
    if callback is not None:
        trainer.add_callback(callback)
    trainer.train()
    return _outcome(trainer.model_wrapped, callback.watch.reports if callback is not None else [])


def _outcome(engine: Any, reports: Any) -> dict[str, Any]:
    """What a rank writes: digests of its parameters, fp32 master weights and optimizer state, and its reports."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        module = _digest([p.data.clone() for p in params])
    return {
        "rank": torch.distributed.get_rank(),
        "engine": type(engine).__name__,
        "params": module,
        "master": _digest([safe_get_full_fp32_param(p) for p in params]),
        "optimizer": _digest([v for s in engine.optimizer.optimizer.state.values() for v in s.values() if v.dim()]),
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
            }
            for r in reports
            if r.scope != "update"  # the gradient checks; the update checks apart
        ],
        "updates": [(r.step, r.verdict, r.fault_message) for r in reports if r.scope == "update"],
    }


def _accelerate(kind: str, stage: int, bf16: bool) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed_run import loss_fn

    torch.manual_seed(0)
    model = Net(1.03 if kind == "accelerate_formula" else 1.0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
    }
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), gradient_accumulation_steps=2)
    engine, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    points = Points(torch.distributed.get_rank())
    dtype = torch.bfloat16 if bf16 else torch.float32
    data = [(points.x[i : i + 4].to(dtype), points.y[i : i + 4]) for i in range(0, 24, 4)]
    watch, hook = None, None
    if kind != "accelerate_baseline":
        watch = GradientWatch(every_n_steps=2, applied_every_n_steps=1, max_overhead=None, verbose=False)
        hook = applied_checks_inside_steps(engine, watch, loss_fn)  # the engine steps inside accelerator.backward
    for batch in data:
        with accelerator.accumulate(engine):
            if watch is not None:
                watch.record(batch, model=engine.module, step=engine.global_steps + 1)
            accelerator.backward(loss_fn(engine, batch))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients and watch is not None:
            watch.maybe_check(engine.module, batch, loss_fn, step=engine.global_steps)
    if hook is not None:
        hook.remove()
    return _outcome(engine, watch.reports if watch is not None else [])


def main() -> None:
    out = Path(sys.argv[1])
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    # the Trainer refuses bf16 under DeepSpeed without a GPU; DeepSpeed itself trains in bf16 on CPU
    transformers.training_args.is_torch_bf16_gpu_available = lambda: True
    for scenario in sys.argv[2:]:
        kind, stage, dtype = scenario.split("-")
        if kind.startswith("accelerate"):
            result = _accelerate(kind, int(stage.removeprefix("z")), dtype == "bf16")
        else:
            result = run(kind, int(stage.removeprefix("z")), dtype == "bf16", out)
        (out / f"{scenario}_rank{result['rank']}.json").write_text(json.dumps(result))
        AcceleratorState._reset_state()  # one Accelerator with a DeepSpeed plugin per state: the next fit makes its own
    torch.distributed.barrier()
    leave_without_teardown()


if __name__ == "__main__":
    main()
