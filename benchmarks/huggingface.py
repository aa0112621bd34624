"""The cost of a check on Hugging Face models under the ``transformers.Trainer``, in training steps of the same run.

Tiny randomly initialised models (``tests/hf_stack_models.py``; GPT-2 from a config of the same size) train on
synthetic token sequences (batch 4, length 12) with ``GradWatchCallback`` checking every ``--every`` optimizer steps.
Each setup runs twice: without gradwatch, for the median time of a training step (timed from ``on_step_begin`` to
``on_step_end``), and with it, for the median time of a check (``report.duration_s``). Setups: a Llama and a GPT-2 in
float32, a Llama with a PEFT LoRA adapter, and TRL's ``SFTTrainer`` at its defaults (bf16 autocast, activation
checkpointing) on the Llama.

Run: ``python benchmarks/huggingface.py [--checks N] [--every K] [--threads T]`` (a minute or two on 2 CPU cores).
Timings on a shared machine jitter; ``--threads 1`` (the default) keeps OpenMP from spinning on busy cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hf_stack_models import VOCAB, Tokens, language_modeling_dataset, tiny_llama, tiny_tokenizer

from gradwatch.integrations.huggingface import GradWatchCallback


class StepTimer(transformers.TrainerCallback):
    """The wall time of each optimizer step, from ``on_step_begin`` to ``on_step_end``."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._started = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._started = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seconds.append(time.perf_counter() - self._started)


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def lora_llama() -> torch.nn.Module:
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(tiny_llama(), config)


def trainer(make_model: Callable[[], torch.nn.Module], sft: bool, steps: int, output: str) -> Any:
    common = {
        "output_dir": output,
        "per_device_train_batch_size": 4,
        "max_steps": steps,
        "report_to": "none",
        "use_cpu": True,
        "save_strategy": "no",
        "seed": 0,
        "disable_tqdm": True,
    }
    if sft:
        import trl

        return trl.SFTTrainer(
            model=make_model(),
            args=trl.SFTConfig(**common),  # type: ignore[arg-type]
            train_dataset=language_modeling_dataset(count=4 * steps),
            processing_class=tiny_tokenizer(),
        )
    args = transformers.TrainingArguments(**common)  # type: ignore[arg-type]
    return transformers.Trainer(model=make_model(), args=args, train_dataset=Tokens(count=4 * steps))


SETUPS: list[tuple[str, Callable[[], torch.nn.Module], bool]] = [
    ("Llama (2 layers), float32", tiny_llama, False),
    ("GPT-2 (2 layers), float32", gpt2, False),
    ("Llama + PEFT LoRA, float32", lora_llama, False),
    ("Llama, TRL SFTTrainer defaults (bf16 autocast, activation checkpointing)", tiny_llama, True),
]


def run(make_model: Callable[[], torch.nn.Module], sft: bool, checks: int, every: int) -> dict[str, Any]:
    steps = checks * every
    with tempfile.TemporaryDirectory() as output, contextlib.redirect_stdout(io.StringIO()):  # the Trainer's log lines
        plain = trainer(make_model, sft, steps, output)
        timer = StepTimer()
        plain.add_callback(timer)
        plain.train()
        watched = trainer(make_model, sft, steps, output)
        callback = GradWatchCallback(watched, every_n_steps=every, first_check_step=None, max_overhead=None)
        watched.add_callback(callback)
        watched.train()
    return {"step_s": statistics.median(timer.seconds[1:]), "reports": callback.reports}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", type=int, default=4, help="checks per setup")
    parser.add_argument("--every", type=int, default=5, help="optimizer steps between checks")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: leave torch's default)")
    args = parser.parse_args()
    for name in ("transformers", "gradwatch", "trl", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import datasets

    datasets.disable_progress_bars()
    if args.threads:
        torch.set_num_threads(args.threads)

    threads = torch.get_num_threads()
    print(f"{args.checks} checks per setup, one every {args.every} optimizer steps; {threads} thread(s)\n")
    print("| setup | verdicts | precision | loss evaluations per check | forward passes per check | ms per check | "
          "ms per training step | training steps per check |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, make_model, sft in SETUPS:
        result = run(make_model, sft, args.checks, args.every)
        reports = result["reports"]
        verdicts = "/".join(r.verdict for r in reports)
        precision = "/".join(sorted({r.precision for r in reports}))
        evaluations = statistics.median(r.n_forward for r in reports)
        passes = statistics.median(r.n_passes for r in reports)
        seconds = statistics.median(r.duration_s for r in reports)
        print(f"| {name} | {verdicts} | {precision} | {evaluations:.0f} | {passes:.0f} | {1e3 * seconds:.0f} | "
              f"{1e3 * result['step_s']:.0f} | {seconds / result['step_s']:.1f} |")  # fmt: skip
        sys.stdout.flush()


if __name__ == "__main__":
    main()
