"""The NT-Xent loss over a hand-written ``GatherLayer`` of ``tests/gather_loss_run.py`` in a ``transformers.Trainer``
(DDP, two processes, CPU, gloo) under a :class:`~gradwatch.integrations.huggingface.GradWatchCallback` with both kinds
of check at step 1; each rank writes what the checks said to ``OUT_DIR/<backward>_rank<r>.json``.

Usage: ``python tests/gather_loss_trainer_run.py OUT_DIR BACKWARD...`` on every rank (``two_processes.run_launched``);
``tests/watch/test_collective_losses.py`` runs it. The backwards are those of ``gather_loss_run.py``; each is a fit of
two optimizer steps, and for ``correct`` an unwatched one too, for bit-identity. Each rank trains on its own data.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate import PartialState
from ddp_run import _digest
from gather_loss_run import Contrastive, _Gather, _said, nt_xent
from torch import Tensor, nn
from torch.utils.data import Dataset
from two_processes import leave_without_teardown

from gradwatch.integrations.huggingface import GradWatchCallback


class TrainerContrastive(nn.Module):
    """The contrastive encoder as the Trainer trains a model: the loss in the forward's output."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Contrastive()

    def forward(self, a: Tensor, b: Tensor) -> dict[str, Tensor]:
        return {"loss": nt_xent(self.net, (a, b))}


class Pairs(Dataset):
    """Two noisy views of each of 16 points, this rank's own."""

    def __init__(self, rank: int) -> None:
        generator = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(16, 6, generator=generator)
        self.a, self.b = (x + 0.1 * torch.randn(16, 6, generator=generator) for _ in range(2))

    def __len__(self) -> int:
        return len(self.a)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"a": self.a[index], "b": self.b[index]}


def _fit(out: Path, watched: bool) -> tuple[nn.Module, GradWatchCallback | None]:
    torch.manual_seed(0)
    model = TrainerContrastive()
    args = transformers.TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=4, max_steps=2, learning_rate=0.1,
        report_to=[], save_strategy="no", seed=0, data_seed=0, disable_tqdm=True, use_cpu=True,
        ddp_backend="gloo", accelerator_config={"use_configured_state": True}, dataloader_drop_last=True,
    )  # fmt: skip
    # each rank its own data (its own seed; the sampler then takes its half)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Pairs(torch.distributed.get_rank()))
    callback = None
    if watched:
        callback = GradWatchCallback(trainer, every_n_steps=1000, applied_every_n_steps=1000, first_check_step=1,
                                     max_overhead=None, verbose=False)  # fmt: skip
        trainer.add_callback(callback)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return model, callback


def run(out: Path, backward: str) -> dict[str, Any]:
    _Gather.mode = backward
    model, callback = _fit(out, watched=True)
    assert callback is not None
    plain = _fit(out, watched=False)[0] if backward == "correct" else model
    watch = callback.watch
    first = {
        kind: next((_said(r) for r in getattr(watch, f"{kind}_reports")), None) for kind in ("applied", "recomputed")
    }
    return {"rank": torch.distributed.get_rank(), "identical": _digest(model) == _digest(plain), **first}


def main() -> None:
    out = Path(sys.argv[1])
    PartialState(cpu=True, backend="gloo")  # MULTI_CPU: the Trainer wraps the model in DDP
    for backward in sys.argv[2:]:
        result = run(out, backward)
        (out / f"{backward}_rank{result['rank']}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    leave_without_teardown()


if __name__ == "__main__":
    main()
