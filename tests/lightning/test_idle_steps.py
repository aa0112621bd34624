"""Lightning's ``GradWatch`` on steps where no check is due: its hooks run no tensor operation and leave no hook."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from helpers import LitClassifier, classification_batch, loader, trainer
from idle_steps import global_hooks, hooks, recorded

from gradwatch import GradWatch


def test_the_hooks_of_a_step_with_no_check_due_touch_no_tensor_and_install_no_hook(tmp_path: Any) -> None:
    module = LitClassifier()
    callback = GradWatch(verbose=False)  # the defaults: both first checks at step 1, the next ones at 500 and 5000
    installed = global_hooks()  # what earlier code left: not the watch's
    operations: list[str] = []
    steps: list[int] = [0]
    hooks_left: list[int] = []

    def idle() -> bool:
        return steps[-1] > 1

    for hook in ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end"):
        setattr(callback, hook, recorded(getattr(callback, hook), operations, idle))

    class Steps(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            steps.append(trainer.global_step + 1)

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
            if idle():
                hooks_left.append(hooks(pl_module, trainer.optimizers[0], before=installed))

    trainer(tmp_path, [Steps(), callback], max_steps=6).fit(module, loader(classification_batch()))
    assert steps[1:] == [1, 2, 3, 4, 5, 6]
    assert sorted(report.scope for report in callback.reports) == ["applied", "recomputed", "update"]  # at step 1
    assert operations == []
    assert hooks_left == [0] * 5
