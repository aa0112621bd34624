"""Run GradWatch in real two-process DDP fits (CPU, gloo) and write what each rank saw to JSON.

Usage: ``python tests/ddp_run.py OUT_DIR [--syncbn]``. ``strategy="ddp"`` starts rank 1 by running this script again,
so it cannot run inside pytest; ``tests/test_ddp.py`` runs it in a subprocess with a timeout and asserts on
``OUT_DIR/<scenario>_rank<r>.json``. Every scenario is a separate ``Trainer.fit`` in the same two processes:

- ``healthy``: BatchNorm + dropout classifier, TensorBoard logger, ``gradient_as_bucket_view=True``;
- ``baseline``: the same seeded run without gradwatch (for zero interference);
- ``bug_on_rank1``: the gradient is wrong on rank 1 only, ``on_fail="stop"``: both ranks must stop together;
- ``raise_on_rank1``: the check raises on rank 1 only, ``on_fail="raise"``: both ranks must raise;
- with ``--syncbn`` instead (two CUDA devices, NCCL): ``syncbn``, the classifier with ``SyncBatchNorm``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from helpers import DropoutBatchNormNet, LitClassifier, LitSeedModel, classification_batch, loader, seed_batch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.tensorboard import SummaryWriter

from gradwatch import GradWatch
from gradwatch.engine.results.notes import codes


class GradsUntouched(pl.Callback):
    """Placed around GradWatch: records ``.grad`` (object, storage, value) just before the check and compares after."""

    def __init__(self) -> None:
        self.saved: list[tuple[torch.nn.Parameter, int, int, torch.Tensor]] = []
        self.untouched = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.saved = [(p, id(p.grad), p.grad.data_ptr(), p.grad.clone()) for p in pl_module.parameters()]

    def compare(self) -> None:
        for param, grad_id, pointer, value in self.saved:
            same = id(param.grad) == grad_id and param.grad.data_ptr() == pointer and torch.equal(param.grad, value)
            self.untouched &= same


class CompareGrads(pl.Callback):
    def __init__(self, recorder: GradsUntouched) -> None:
        self.recorder = recorder

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.recorder.compare()


class RaiseInCheck(pl.Callback):
    """Makes ``training_step`` raise during the check, on rank 1 only (set just before GradWatch's hook)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pl_module.raise_in_step = trainer.global_rank == 1


def _digest(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _trainer(
    out: Path, callbacks: list[pl.Callback], logger: Any = False, max_steps: int = 4, accelerator: str = "cpu"
) -> pl.Trainer:
    backend = "gloo" if accelerator == "cpu" else "nccl"
    return pl.Trainer(
        accelerator=accelerator,
        devices=2,
        strategy=DDPStrategy(process_group_backend=backend, gradient_as_bucket_view=True),
        max_steps=max_steps,
        logger=logger,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(out),
    )


def _result(trainer: pl.Trainer, model: pl.LightningModule, watch: GradWatch | None, **extra: Any) -> dict[str, Any]:
    reports = []
    for report in watch.recomputed_reports if watch is not None else []:
        reports.append(
            {
                "step": report.step,
                "verdict": report.verdict,
                "probes": [[p.kind, p.target, list(p.index) if p.index is not None else None] for p in report.probes],
                "notes": report.notes,
                "note_codes": codes(report.notes),
            }
        )
    return {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "should_stop": trainer.should_stop,
        "finished": trainer.state.finished,
        "reports": reports,
        "counts": watch.counts if watch is not None else None,
        "digest": _digest(model),
        **extra,
    }


def healthy(out: Path, with_watch: bool) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = LitClassifier()  # Linear, BatchNorm1d, ReLU, Dropout, Linear
    watch = GradWatch(every_n_steps=2, max_overhead=None) if with_watch else None
    grads = GradsUntouched()
    callbacks: list[pl.Callback] = [grads, watch, CompareGrads(grads)] if watch is not None else []
    logger = TensorBoardLogger(str(out / "tb"), name="healthy", version=0, default_hp_metric=False)
    trainer = _trainer(out, callbacks, logger=logger if with_watch else False)
    trainer.fit(model, loader(classification_batch(), 8))
    writer = type(logger.experiment).__name__ if with_watch else None
    real_writer = isinstance(logger.experiment, SummaryWriter) if with_watch else None
    return _result(trainer, model, watch, writer=writer, real_writer=real_writer, grads_untouched=grads.untouched)


def bug_on_rank1(out: Path) -> dict[str, Any]:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    model = LitSeedModel(weight_scale=1.1 if rank == 1 else 1.0)  # the backward is wrong on rank 1 only
    watch = GradWatch(every_n_steps=1, max_overhead=None, on_fail="stop")
    trainer = _trainer(out, [watch])
    trainer.fit(model, loader(seed_batch(), 8))
    return _result(trainer, model, watch)


def raise_on_rank1(out: Path) -> dict[str, Any]:
    model = LitClassifier()
    watch = GradWatch(every_n_steps=1, max_overhead=None, on_fail="raise")
    trainer = _trainer(out, [RaiseInCheck(), watch])
    error = None
    try:
        trainer.fit(model, loader(classification_batch(), 8))
    except RuntimeError as caught:
        error = f"{type(caught).__name__}: {caught}"
    return _result(trainer, model, watch, error=error)


def syncbn(out: Path) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = LitClassifier(torch.nn.SyncBatchNorm.convert_sync_batchnorm(DropoutBatchNormNet()))
    watch = GradWatch(every_n_steps=2, max_overhead=None)
    trainer = _trainer(out, [watch], accelerator="gpu")
    trainer.fit(model, loader(classification_batch(), 8))
    patched = any("forward" in m.__dict__ for m in model.modules())
    return _result(trainer, model, watch, forward_left_patched=patched)


def main() -> None:
    out = Path(sys.argv[1])
    if "--syncbn" in sys.argv[2:]:
        result = syncbn(out)
        (out / f"syncbn_rank{result['rank']}.json").write_text(json.dumps(result))
        _close_process_group()
        return
    scenarios = {
        "healthy": lambda: healthy(out, with_watch=True),
        "baseline": lambda: healthy(out, with_watch=False),
        "bug_on_rank1": lambda: bug_on_rank1(out),
        "raise_on_rank1": lambda: raise_on_rank1(out),
    }
    for name, run in scenarios.items():
        result = run()
        (out / f"{name}_rank{result['rank']}.json").write_text(json.dumps(result))
    _close_process_group()


def _close_process_group() -> None:
    """Destroy the process group before the interpreter exits: a gloo group left to the interpreter's shutdown
    sometimes aborts the process ("terminate called without an active exception") after every result was written."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
