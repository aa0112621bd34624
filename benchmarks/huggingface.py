"""The cost of a check on Hugging Face models under the ``transformers.Trainer``, in training steps of the same run.

Tiny randomly initialised models (``tests/hf_stack_models.py``; GPT-2 from a config of the same size) train on
synthetic token sequences (batch 4, length 12) with ``GradWatchCallback`` checking every ``--every`` optimizer steps.
Each setup runs ``--repeats`` times, each time twice: without gradwatch, for the median time of a training step (from
``on_step_begin`` to ``on_step_end``), and with it, for the median time of a check (the callback's ``on_step_end`` at a
checked step, which runs the check; ``report.duration_s`` is the check's own part of it). Setups: a Llama and a GPT-2
in float32, a Llama with a PEFT LoRA adapter, and TRL's ``SFTTrainer`` at its defaults (bf16 autocast, activation
checkpointing) on the Llama.

Both are timed twice: in CPU time of the process (``time.process_time``: the work done, which other jobs on the machine
do not change) and in wall time. On a machine shared with other jobs, wall times jitter by 2-3x from one run to the
next, and a step timed in a quiet moment against a check timed in a busy one (or the reverse) moves the ratio by as
much: hence the CPU-time ratio, the repeats, and the medians. The table gives, per setup, the median over the repeats
of each run's ratio, and the range of the wall-time ratios.

Run: ``python benchmarks/huggingface.py [--checks N] [--every K] [--repeats R] [--threads T]`` (a few minutes on 2 CPU
cores). ``--threads 1`` (the default) keeps OpenMP from spinning on busy cores, and makes CPU time the time a step or
a check takes on a core of its own.
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
    """The time of each optimizer step, from ``on_step_begin`` to ``on_step_end``, in CPU and wall time. Added before
    ``GradWatchCallback``, its ``on_step_end`` runs before the check."""

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self._started = (0.0, 0.0)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._started = (time.process_time(), time.perf_counter())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.cpu.append(time.process_time() - self._started[0])
        self.wall.append(time.perf_counter() - self._started[1])


class CheckTimer(transformers.TrainerCallback):
    """The time of ``GradWatchCallback.on_step_end`` at each step (the check, where there is one): added before the
    callback, with :meth:`after` run by a second callback added after it."""

    def __init__(self) -> None:
        self.cpu: dict[int, float] = {}
        self.wall: dict[int, float] = {}
        self._started = (0.0, 0.0)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._started = (time.process_time(), time.perf_counter())

    def after(self, step: int) -> None:
        self.cpu[step] = time.process_time() - self._started[0]
        self.wall[step] = time.perf_counter() - self._started[1]


class CheckEnd(transformers.TrainerCallback):
    def __init__(self, timer: CheckTimer) -> None:
        self.timer = timer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.timer.after(state.global_step)


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
    """One run without gradwatch and one with it: the median step and check times, in CPU and wall time."""
    steps = checks * every
    with tempfile.TemporaryDirectory() as output, contextlib.redirect_stdout(io.StringIO()):  # the Trainer's log lines
        plain = trainer(make_model, sft, steps, output)
        timer = StepTimer()
        plain.add_callback(timer)
        plain.train()
        watched = trainer(make_model, sft, steps, output)
        check_timer = CheckTimer()
        watched.add_callback(check_timer)
        callback = GradWatchCallback(watched, every_n_steps=every, first_check_step=None, max_overhead=None)
        watched.add_callback(callback)
        watched.add_callback(CheckEnd(check_timer))
        watched.train()
    checked = [r.step for r in callback.reports]
    step_cpu, step_wall = statistics.median(timer.cpu[1:]), statistics.median(timer.wall[1:])
    check_cpu = statistics.median(check_timer.cpu[s] for s in checked)
    check_wall = statistics.median(check_timer.wall[s] for s in checked)
    return {
        "reports": callback.reports,
        "check_cpu": check_cpu,
        "check_wall": check_wall,
        "step_cpu": step_cpu,
        "step_wall": step_wall,
        "ratio_cpu": check_cpu / step_cpu,
        "ratio_wall": check_wall / step_wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", type=int, default=4, help="checks per run")
    parser.add_argument("--every", type=int, default=5, help="optimizer steps between checks")
    parser.add_argument("--repeats", type=int, default=3, help="runs per setup (medians over them)")
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
    print(
        f"{args.checks} checks per run, one every {args.every} optimizer steps, {args.repeats} runs per setup; "
        f"{threads} thread(s)\n"
    )
    print("| setup | verdicts | precision | loss evaluations / forward passes per check | ms per check, CPU | ms per "
          "training step, CPU | training steps per check, CPU | training steps per check, wall (range) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, make_model, sft in SETUPS:
        results = [run(make_model, sft, args.checks, args.every) for _ in range(args.repeats)]
        reports = [r for result in results for r in result["reports"]]
        counted = sorted({r.verdict for r in reports})
        verdicts = ", ".join(f"{sum(r.verdict == v for r in reports)} {v}" for v in counted)
        precision = "/".join(sorted({r.precision for r in reports}))
        evaluations = statistics.median(r.n_forward for r in reports)
        passes = statistics.median(r.n_passes for r in reports)
        check_cpu = statistics.median(r["check_cpu"] for r in results)
        step_cpu = statistics.median(r["step_cpu"] for r in results)
        ratio_cpu = statistics.median(r["ratio_cpu"] for r in results)
        walls = [r["ratio_wall"] for r in results]
        print(f"| {name} | {verdicts} | {precision} | {evaluations:.0f} / {passes:.0f} | {1e3 * check_cpu:.0f} | "
              f"{1e3 * step_cpu:.1f} | {ratio_cpu:.1f} | {statistics.median(walls):.1f} "
              f"({min(walls):.1f}-{max(walls):.1f}) |")  # fmt: skip
        sys.stdout.flush()


if __name__ == "__main__":
    main()
