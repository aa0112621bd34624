"""What a failing check costs, in training steps of the same run, with and without the cap on its culprit search.

A backward bug planted in one layer (a 3% error in an input gradient) makes every check fail; a failing check then
searches for the module at fault (the applied check through a recomputed check of its first micro-batch, the
recomputed check directly), and that search is what a failing check costs beyond a healthy one. Each setup trains
``--steps`` steps with both kinds of check every ``--every`` steps (and at step 1), once per cap:

* ``none``: ``max_culprit_search_steps=None``, the search runs to its end (what every failing check did before the cap);
* ``100 (default)``: the watch's defaults (100 training steps, never under 30 s);
* ``main`` (``--caps main``, run with another checkout first on the path): the code before the cap, where the
  recomputed check after a failing applied check searched from the loss again;
* ``tight``: a cap of ``--tight`` steps and no 30-second floor, so that the cap bites on these small models too and the
  search is spread over checks (the continuation a large model's search relies on).

Per run: the cost of step 1's two failing checks (applied and recomputed) in training steps, by the CPU time of the
process (``time.thread_time`` around each optimizer step, one thread, the median of the healthy steps as the unit);
whether the first checks' searches stopped at the cap; and which check named the planted module (its step and kind).

Setups: a tiny ``LlamaForCausalLM`` from a config (``tests/hf_stack_models.py``; the bug in one decoder layer's MLP
activation) under ``transformers.Trainer`` with ``GradWatchCallback``, at 2 and 8 layers; a Lightning MLP of 8 hidden
layers with ``GradWatch()`` (the bug in one layer's hand-written tanh).

Run: ``python benchmarks/failing_check.py [--steps N] [--every K] [--tight T] [--only NAME]`` (a few minutes on 2
CPU cores).
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
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from culprit_models import Tanh
from hf_stack_models import Tokens, plant_activation_bug, tiny_llama

CAPS: dict[str, tuple[int | str | None, float | None]] = {"none": (None, None), "100 (default)": (100, None)}
"""Per label: ``max_culprit_search_steps`` and the search's floor in seconds (``None``: the watch's own); ``"main"``
passes no cap at all, for a run of the code before the cap (``PYTHONPATH=<that checkout>``, ``--caps main``)."""


class StepClock:
    """The CPU time of each optimizer step, checks included (the timer's end runs after the watch's)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._started = 0.0

    def begin(self) -> None:
        self._started = time.thread_time()

    def end(self) -> None:
        self.seconds.append(time.thread_time() - self._started)


def _culprit_at(reports: list[Any], planted: str) -> str:
    named = next((r for r in reports if r.culprits and r.culprits[0] == planted), None)
    return "none" if named is None else f"step {named.step}, {named.scope}"


def _stopped(reports: list[Any]) -> str:
    """What the failing checks of step 1 spent on their searches, and whether the searches ended."""
    first = [r for r in reports if r.step == 1 and r.scope in ("applied", "recomputed") and r.n_forward]
    marks = []
    for report in sorted(first, key=lambda r: r.scope):
        search = getattr(report, "culprit_search", None)  # None before the cap
        if search is None:
            marks.append(f"{report.scope}: {report.n_forward} evaluations in all")
            continue
        ended = "complete" if search.complete else f"stopped, {len(search.candidates)} candidates left"
        marks.append(f"{report.scope}: {ended}, {search.evaluations} evaluations")
    return "; ".join(marks)


def _watch_options(cap: int | str | None, every: int) -> dict[str, Any]:
    options = {"every_n_steps": every, "applied_every_n_steps": every, "max_overhead": None, "verbose": False,
               "on_fail": "warn"}  # fmt: skip
    return options if cap == "main" else {**options, "max_culprit_search_steps": cap}


def _floor(watch: Any, seconds: float | None) -> None:
    if seconds is not None:
        watch._lessons.search_min_seconds = seconds  # the benchmark's tight cap: no 30-second floor


def llama_run(
    layers: int, steps: int, every: int, cap: int | str | None, floor: float | None
) -> tuple[list[float], list[Any], str]:
    """A Trainer run of a tiny Llama with a bug in the MLP activation of its last-but-one decoder layer."""
    import transformers

    from gradwatch.integrations.huggingface import GradWatchCallback

    model = tiny_llama(layers=layers)
    planted = plant_activation_bug(model, max(layers - 2, 0))
    clock = StepClock()

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            clock.begin()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            clock.end()

    with tempfile.TemporaryDirectory() as output:
        args = transformers.TrainingArguments(output_dir=output, per_device_train_batch_size=4, max_steps=steps,
                                              report_to="none", use_cpu=True, save_strategy="no", seed=0,
                                              disable_tqdm=True, logging_strategy="no")  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(count=4 * steps))
        callback = GradWatchCallback(trainer, **_watch_options(cap, every))
        _floor(callback.watch, floor)
        trainer.add_callback(callback)
        trainer.add_callback(Timer())  # after the watch: its step end includes the recomputed check
        trainer.train()
    return clock.seconds, callback.reports, planted


class MLP(nn.Module):
    def __init__(self, depth: int = 8, width: int = 64, bug_at: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), Tanh(1.03 if i == bug_at else 1.0)) for i in range(depth)
        )
        self.head = nn.Linear(width, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def lightning_run(
    steps: int, every: int, cap: int | str | None, floor: float | None
) -> tuple[list[float], list[Any], str]:
    """A Lightning run of the MLP with a bug in the tanh of its sixth hidden layer."""
    import lightning.pytorch as pl

    from gradwatch import GradWatch

    clock = StepClock()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = MLP()

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Timer(pl.Callback):
        def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
            clock.begin()

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            clock.end()

    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32 * steps, 16, generator=generator),
                                          torch.randint(0, 4, (32 * steps,), generator=generator))  # fmt: skip
    watch = GradWatch(**_watch_options(cap, every))
    _floor(watch.watch, floor)
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[watch, Timer()])  # fmt: skip
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=32))
    return clock.seconds, watch.reports, "net.layers.5.1"


SETUPS: dict[str, tuple[str, Callable[..., tuple[list[float], list[Any], str]]]] = {
    "Llama (2 layers)": ("Trainer", lambda *a: llama_run(2, *a)),
    "Llama (8 layers)": ("Trainer", lambda *a: llama_run(8, *a)),
    "MLP (8 hidden layers)": ("Lightning", lightning_run),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=31)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--tight", type=int, default=5, help="the tight cap, in training steps (no 30 s floor)")
    parser.add_argument("--only", default=None, help="run only the setups whose name contains this")
    parser.add_argument("--caps", default="none,default,tight", help="which of none, default, tight, main to run")
    options = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    every = {**CAPS, f"tight ({options.tight}, no floor)": (options.tight, 0.0), "before the cap": ("main", None)}
    keys = {"none": "none", "default": "100 (default)", "tight": f"tight ({options.tight}, no floor)",
            "main": "before the cap"}  # fmt: skip
    caps = {keys[k]: every[keys[k]] for k in options.caps.split(",")}
    print("| model | loop | cap (training steps) | step 1's failing checks (training steps, CPU) | "
          "their loss evaluations | first searches | culprit named at | checks failing |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, (loop, run) in SETUPS.items():
        if options.only and options.only not in name:
            continue
        for label, (cap, floor) in caps.items():
            with contextlib.redirect_stdout(io.StringIO()):
                seconds, reports, planted = run(options.steps, options.every, cap, floor)
            checked = {r.step for r in reports}
            healthy = statistics.median(s for step, s in enumerate(seconds, start=1) if step not in checked)
            first = (seconds[0] - healthy) / healthy
            evaluations = sum(r.n_forward for r in reports if r.step == 1 and r.scope in ("applied", "recomputed"))
            failing = sum(r.verdict == "fail" for r in reports if r.scope in ("applied", "recomputed"))
            print(f"| {name} | {loop} | {label} | {first:.0f} | {evaluations} | {_stopped(reports)} | "
                  f"{_culprit_at(reports, planted)} | {failing} |")  # fmt: skip
            sys.stdout.flush()


if __name__ == "__main__":
    main()
