"""The Hugging Face ``GradWatchCallback`` on steps where no check is due: its hooks and its wrappers of the Trainer's
``compute_loss`` and clipping run no tensor operation of their own and leave no hook."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from idle_steps import global_hooks, hooks, recorded
from torch import nn

transformers = pytest.importorskip("transformers")

from gradwatch.integrations.huggingface import GradWatchCallback  # noqa: E402


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.fc2(torch.tanh(self.fc1(x)))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def test_the_hooks_of_a_step_with_no_check_due_touch_no_tensor_and_install_no_hook(tmp_path: Path) -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(8, generator=generator), "labels": torch.tensor(i % 3)} for i in range(48)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=8, report_to=[], save_strategy="no",
        logging_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    model = _Classifier()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    callback = GradWatchCallback(trainer, verbose=False)  # the defaults: both first checks at step 1
    installed = global_hooks()  # what earlier code left: not the watch's
    operations: list[str] = []
    steps: list[int] = [0]
    hooks_left: list[int] = []

    def idle() -> bool:
        return steps[-1] > 1

    for name in ("on_step_begin", "on_pre_optimizer_step", "on_step_end", "_keep", "_check_applied"):
        setattr(callback, name, recorded(getattr(callback, name), operations, idle))
    callback.watch.after_clipping = recorded(callback.watch.after_clipping, operations, idle)  # type: ignore[method-assign]

    class Steps(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            steps.append(state.global_step + 1)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if idle():
                hooks_left.append(hooks(model, trainer.optimizer, before=installed))

    trainer.add_callback(Steps())
    trainer.add_callback(callback)
    trainer.train()
    assert steps[1:] == [1, 2, 3, 4, 5, 6]
    # at step 1: the applied check, the clip coefficient's (max_grad_norm=1), the recomputed one, the update's
    assert sorted(report.scope for report in callback.reports) == ["applied", "applied", "recomputed", "update"]
    assert operations == []
    assert hooks_left == [0] * 5
