"""The NT-Xent loss over a hand-written ``GatherLayer`` of ``tests/gather_loss_run.py``, trained by Lightning (DDP
strategy, two processes, CPU, gloo) under a :class:`~gradwatch.GradWatch` with both kinds of check at step 1, and the
same loss given to :func:`~gradwatch.check_gradients` called directly on each rank (bare and DDP-wrapped); each rank
writes what the checks said to ``OUT_DIR/<scenario>_rank<r>.json``.

Usage: ``python tests/gather_loss_lightning_run.py OUT_DIR SCENARIO...``; ``strategy="ddp"`` starts rank 1 by running
this script again, so ``tests/watch/test_collective_losses.py`` runs it in a subprocess (``two_processes.run_ranks``).
The scenarios name the layer's backwards of ``gather_loss_run.py`` (``correct``, ``local_slot``, ``all_reduce_none``,
``summed_slots``): ``fit_<backward>`` is a Lightning fit (for ``correct`` an unwatched one too, for bit-identity),
``direct_<backward>`` the direct calls, after a fit (which starts rank 1); ``direct_split`` a direct call on ranks that
hold other parameters, ``direct_raise`` one whose loss raises on rank 1 alone. The Trainer's sampler gives each rank its
own data.
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from ddp_run import _close_process_group, _digest
from gather_loss_run import Contrastive, _Gather, _said, nt_xent
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from gradwatch import GradWatch, check_gradients
from gradwatch.engine.results.notes import codes


class LitContrastive(Contrastive, pl.LightningModule):
    """The contrastive encoder as a LightningModule whose ``training_step`` is the gathered NT-Xent loss."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = nt_xent(self, batch)
        self.log("loss", loss, sync_dist=True)  # a collective in training, silenced in a check
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _pairs(samples: int = 32) -> DataLoader:
    """Two noisy views of each of ``samples`` points, 4 pairs a batch (the sampler gives each rank its own)."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(samples, 6, generator=generator)
    views = [x + 0.1 * torch.randn(samples, 6, generator=generator) for _ in range(2)]
    return DataLoader(TensorDataset(*views), batch_size=4)


def _fit(out: Path, watched: bool) -> tuple[pl.Trainer, LitContrastive, GradWatch | None]:
    pl.seed_everything(0, verbose=False)
    model = LitContrastive()
    watch = (
        GradWatch(every_n_steps=1000, applied_every_n_steps=1000, first_check_step=1, max_overhead=None, verbose=False)
        if watched
        else None
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo"), max_steps=2, logger=False,
        callbacks=[watch] if watch is not None else [], enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=str(out),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, _pairs())
    return trainer, model, watch


def fit(out: Path, backward: str) -> dict[str, Any]:
    """A watched fit of two steps (and for the correct layer an unwatched one): what the first checks of each kind
    said, and whether training was bit-identical."""
    _Gather.mode = backward
    trainer, model, watch = _fit(out, watched=True)
    assert watch is not None
    plain = _fit(out, watched=False)[1] if backward == "correct" else model
    first = {
        kind: next((_said(r) for r in getattr(watch, f"{kind}_reports")), None) for kind in ("applied", "recomputed")
    }
    return {"rank": trainer.global_rank, "identical": _digest(model) == _digest(plain), **first}


def direct(backward: str) -> dict[str, Any]:
    """:func:`check_gradients` called on each rank on its own batch, on the bare model and on it wrapped in DDP."""
    _Gather.mode = backward
    said: dict[str, Any] = {"rank": dist.get_rank()}
    for wrapped in (False, True):
        torch.manual_seed(0)
        model: torch.nn.Module = Contrastive()
        if wrapped:
            model = DistributedDataParallel(model)
        before = _digest(model)
        generator = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own data
        x = torch.randn(4, 6, generator=generator)
        batch = (x + 0.1 * torch.randn(4, 6, generator=generator), x + 0.1 * torch.randn(4, 6, generator=generator))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = check_gradients(model, batch, nt_xent, step=1)
        said["ddp" if wrapped else "bare"] = {**_said(report), "unchanged": _digest(model) == before}
    return said


def split() -> dict[str, Any]:
    """:func:`check_gradients` of the correct layer's loss on a model that rank 1 holds with another hidden width (a
    model split by hand): no replicas to average; each rank's gradient is checked against the ranks' summed loss."""
    _Gather.mode = "correct"
    torch.manual_seed(0)
    model = Contrastive()
    if dist.get_rank() == 1:  # another hidden width: parameters of other shapes, every one of them used
        model.encoder = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8))
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    x = torch.randn(4, 6, generator=generator)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = check_gradients(model, (x, x + 0.1 * torch.randn(4, 6, generator=generator)), nt_xent, step=1)
    return {"rank": dist.get_rank(), **_said(report), "codes": codes(report.notes)}


def raising() -> dict[str, Any]:
    """:func:`check_gradients` of a loss whose backward raises on rank 1 alone, after the forward's collectives: rank 1
    raises, rank 0 reports ``inconclusive`` (neither waits for the other)."""
    _Gather.mode = "raise_on_rank1"
    torch.manual_seed(0)
    model = Contrastive()
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    x = torch.randn(4, 6, generator=generator)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = check_gradients(model, (x, x + 0.1 * torch.randn(4, 6, generator=generator)), nt_xent, step=1)
    except RuntimeError as error:
        return {"rank": dist.get_rank(), "raised": str(error)}
    return {"rank": dist.get_rank(), "raised": None, **_said(report)}


def main() -> None:
    import json

    out = Path(sys.argv[1])
    for scenario in sys.argv[2:]:
        kind, _, backward = scenario.partition("_")
        if kind == "fit":
            result = fit(out, backward)
        else:
            result = {"split": split, "raise": raising}.get(backward, functools.partial(direct, backward))()
        (out / f"{scenario}_rank{result['rank']}.json").write_text(json.dumps(result))
    _close_process_group()


if __name__ == "__main__":
    main()
