"""One applied check under the Hugging Face ``Trainer`` and TRL's ``SFTTrainer`` at their defaults, in training steps.

``GradWatchCallback(trainer)`` at its defaults makes the applied check at the first optimizer step (then every 5000
within the 1% budget), and after it the check of the clip coefficient. A tiny Llama from ``tests/hf_stack_models.py``
(batch 4 x 12 tokens) trains 8 steps without gradwatch, for the median training step (wall time from
``on_step_begin`` to ``on_step_end``, steps 3 on), then with it, for the step-1 applied check's ``report.duration_s``;
with gradient accumulation 1 and 4. Prints a markdown table.

Run: ``python benchmarks/huggingface_applied.py`` (about a minute on 2 CPU cores; one thread).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import transformers
import trl
from hf_stack_models import Tokens, language_modeling_dataset, tiny_llama, tiny_tokenizer
from transformers import TrainerCallback

from gradwatch.engine.results.notes import NoteCode
from gradwatch.integrations.huggingface import GradWatchCallback


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step, from ``on_step_begin`` to ``on_step_end``."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.started = 0.0

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self.started = time.perf_counter()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.seconds.append(time.perf_counter() - self.started)


def _run(kind: str, accumulation: int, watched: bool, out: str) -> tuple[list[float], GradWatchCallback | None]:
    common: dict[str, Any] = {
        "output_dir": out, "max_steps": 8, "per_device_train_batch_size": 4, "report_to": "none", "use_cpu": True,
        "save_strategy": "no", "logging_steps": 1, "seed": 0, "disable_tqdm": True,
        "gradient_accumulation_steps": accumulation,
    }  # fmt: skip
    if kind == "sft":
        dataset, tokenizer = language_modeling_dataset(), tiny_tokenizer()
        trainer: Any = trl.SFTTrainer(
            model=tiny_llama(), args=trl.SFTConfig(**common), train_dataset=dataset, processing_class=tokenizer
        )
    else:
        trainer = transformers.Trainer(model=tiny_llama(), args=transformers.TrainingArguments(**common),
                                       train_dataset=Tokens())  # fmt: skip
    timer = StepTimer()
    trainer.add_callback(timer)
    callback = None
    if watched:
        callback = GradWatchCallback(trainer)  # the defaults
        trainer.add_callback(callback)
    trainer.train()
    return timer.seconds, callback


def main() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    names = {
        "trainer": "`transformers.Trainer`, float32",
        "sft": "TRL `SFTTrainer` at its defaults (bf16, checkpointing)",
    }
    columns = ("trainer", "accumulation", "training step", "applied check", "in training steps", "loss evaluations",
               "reports at step 1")  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as out:
        for kind in ("trainer", "sft"):
            for accumulation in (1, 4):
                steps, _ = _run(kind, accumulation, False, out)
                step = statistics.median(steps[2:])
                _, callback = _run(kind, accumulation, True, out)
                assert callback is not None
                applied = next(r for r in callback.applied_reports if not r.noted(NoteCode.APPLIED_CLIPPING))
                reports = ", ".join(f"{r.scope} {r.verdict}" for r in callback.reports if r.step == 1)
                print(f"| {names[kind]} | {accumulation} | {step * 1e3:.1f} ms | {applied.duration_s * 1e3:.0f} ms "
                      f"| {applied.duration_s / step:.1f} | {applied.n_forward} | {reports} |")  # fmt: skip


if __name__ == "__main__":
    main()
