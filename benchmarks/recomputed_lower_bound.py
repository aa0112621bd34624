"""A healthy recomputed check against its own lower bound, per benchmark model and precision, measured in one run.

The lower bound of a check is what its loss evaluations would cost with no work of the check's own: each evaluation at
the measured cost of one forward in the probes' precision (no grad, float64 storage for a float32 model at the
default ``precision="auto"``), plus its backward passes at the cost of one forward and backward (native, as the
reference gradient), both on the probe batch (the first ``probe_batch_size`` samples; ``docs/benchmarks.md``, "Cost by
cadence"). Vectorised passes evaluate several points in one forward, so a check can beat this bound; the Python work
of a check (guards, state capture and restore, contexts, directions) is what stands above it.

Models: the CIFAR CNN (batch 128) and GPT LM (32 x 64 tokens) of ``benchmarks/overhead.py`` and the MLP, CNN and
transformer of ``benchmarks/applied.py``'s cost table (batch 64), each float32 and bf16-mixed (the training step's
forward under CPU autocast to bfloat16; the loss enters autocast itself, as Accelerate's wrapped ``forward`` does, and
the check holds it off: its reference and probes run outside autocast, so its bound is the float32 one). A plain loop
with AdamW; one thread; CPU time of the thread (``time.thread_time``); the training step, the bound's unit costs and
the check interleaved round by round, medians over the rounds. Checks at ``GradientWatch``'s settings (2 probe
samples), one warm-up check first (a process's first check pays one-time imports).

Run: ``OMP_NUM_THREADS=1 python benchmarks/recomputed_lower_bound.py [--rounds N]`` (a few minutes on one CPU core).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead
from applied_models import CNN, MLP, Transformer, batch_for, cross_entropy

from gradwatch import GradientWatch, check_gradients

Loss = Callable[[nn.Module, Any], torch.Tensor]


def _image_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _cases() -> list[tuple[str, Callable[[], nn.Module], Any, Loss]]:
    """Each model with its training batch and loss (a fresh model per precision, the same seed)."""
    cases: list[tuple[str, Callable[[], nn.Module], Any, Loss]] = []
    generator = torch.Generator().manual_seed(0)
    images = (torch.randn(128, 3, 32, 32, generator=generator), torch.randint(0, 10, (128,), generator=generator))
    cases.append(("CNN, `overhead.py`, batch 128", overhead.CNN, images, _image_loss))
    tokens = (torch.randint(0, 512, (32, 65), generator=generator),)
    cases.append(("GPT LM, `overhead.py`, 32 x 64 tokens", lambda: overhead.GPT(512, 128, 2, 4, 64), tokens,
                  overhead._lm_loss))  # fmt: skip
    for name, make in (("MLP", MLP), ("CNN (BatchNorm, dropout)", CNN), ("transformer (dropout)", Transformer)):
        batch = batch_for(make(), size=64, seed=1)
        cases.append((f"{name}, `applied.py`, batch 64", make, batch, cross_entropy))
    return cases


def _in_autocast(loss: Loss) -> Loss:
    """``loss`` with its forward under CPU autocast to bfloat16 (bf16-mixed)."""

    def autocast_loss(model: nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss(model, batch)

    return autocast_loss


def _seconds(function: Callable[[], Any]) -> float:
    """The thread's CPU time of one call."""
    started = time.thread_time()
    function()
    return time.thread_time() - started


def _first(batch: Any, samples: int) -> Any:
    return tuple(t[:samples] for t in batch)


def _row(name: str, make: Callable[[], nn.Module], batch: Any, losses: tuple[Loss, Loss], rounds: int) -> dict:
    """The training step, the bound's unit costs and the check, interleaved for ``rounds`` rounds: ``losses`` are the
    training's loss (the step's and the check's) and the loss as the check evaluates it (outside autocast: the
    bound's)."""
    loss, evaluated = losses
    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    settings = GradientWatch().settings  # what a series of checks passes to every check
    samples = settings.probe_batch_size
    probe = _first(batch, samples)
    precise = copy.deepcopy(model).double()
    precise_probe = tuple(t.double() if t.is_floating_point() else t for t in probe)

    def step() -> None:
        optimizer.zero_grad()
        loss(model, batch).backward()
        optimizer.step()

    def forward() -> None:
        with torch.no_grad():
            evaluated(precise, precise_probe)

    def forward_backward() -> None:
        torch.autograd.grad(evaluated(model, probe), [p for p in model.parameters() if p.requires_grad])

    reports = []

    def check() -> None:
        reports.append(check_gradients(model, batch, loss, step=len(reports), settings=settings))

    for warm_up in (step, forward, forward_backward, check):
        warm_up()
    times: dict[str, list[float]] = {"step": [], "forward": [], "forward_backward": [], "check": []}
    for _ in range(rounds):
        times["step"].append(_seconds(step))
        times["forward"].append(statistics.median(_seconds(forward) for _ in range(3)))
        times["forward_backward"].append(statistics.median(_seconds(forward_backward) for _ in range(3)))
        times["check"].append(_seconds(check))
    timed = reports[1:]  # the warm-up's report left out
    assert all(r.verdict == "ok" for r in timed), [str(r) for r in timed if r.verdict != "ok"]
    median = {key: statistics.median(values) for key, values in times.items()}
    evaluations = statistics.median(r.n_forward for r in timed)
    backward = statistics.median(r.n_backward for r in timed)
    bound = (evaluations - backward) * median["forward"] + backward * median["forward_backward"]
    return {
        "name": name,
        "step": median["step"],
        "bound": bound,
        "check": median["check"],
        "evaluations": sorted({r.n_forward for r in timed}),
        "passes": sorted({r.n_passes for r in timed}),
        "precision": timed[-1].precision,
        "samples": timed[-1].samples,
    }


def _counts(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per row (medians over them)")
    parser.add_argument("--model", help="only the models whose name contains this")
    options = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | precision | training step (ms) | bound (ms) | check (ms) | check / bound | loss evaluations "
          "| forward passes | check / training step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, make, batch, loss in _cases():
        if options.model and options.model not in name:
            continue
        for precision, wrapped in (("float32", loss), ("bf16-mixed", _in_autocast(loss))):
            row = _row(name, make, batch, (wrapped, loss), options.rounds)
            print(
                f"| {name} | {precision} | {1e3 * row['step']:.1f} | {1e3 * row['bound']:.1f} "
                f"| {1e3 * row['check']:.1f} | **{row['check'] / row['bound']:.2f}x** | {_counts(row['evaluations'])} "
                f"| {_counts(row['passes'])} | {row['check'] / row['step']:.2f} |",
                flush=True,
            )
    print("\n(CPU time of one thread; probes", row["precision"], "on", row["samples"], "samples)")


if __name__ == "__main__":
    main()
