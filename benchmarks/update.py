"""The update check (issue 42): what one costs, in training steps, on a small MLP and a tiny transformer.

Usage: ``python benchmarks/update.py [--repeats N]`` (CPU, well under a minute). Prints a markdown table: per model and
optimizer, the least time over the repeats of a training step (forward, backward, ``optimizer.step()``) and of one
update check (the copies kept before the step of the three tensors it compares, their float64 reference and the
floor's re-run after it), that cost in training steps, and the largest discrepancy of a healthy check in units of its
tolerance (a failure needs more than 1).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from applied_models import MLP, Transformer, batch_for, cross_entropy

from gradwatch.engine.update import UpdateSnapshot, check_update, update_tensors

MODELS: dict[str, Callable[[], torch.nn.Module]] = {"MLP": lambda: MLP(width=256), "transformer": Transformer}
OPTIMIZERS: dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer]] = {
    "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
    "SGD (Nesterov)": lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, nesterov=True),
    "Muon": lambda m: torch.optim.Muon([p for p in m.parameters() if p.ndim == 2], lr=0.02),
    "Adagrad (replayed)": lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-2),
}


def _measure(
    model: torch.nn.Module, make: Callable[[torch.nn.Module], Any], repeats: int
) -> tuple[float, float, float]:
    optimizer = make(model)
    steps, checks, excess = [], [], 0.0
    for seed in range(repeats):
        batch = batch_for(model, size=64, seed=seed)
        started = time.perf_counter()
        optimizer.zero_grad()
        cross_entropy(model, batch).backward()
        optimizer.step()
        steps.append(time.perf_counter() - started)
        optimizer.zero_grad()
        cross_entropy(model, batch).backward()
        started = time.perf_counter()
        snapshot = UpdateSnapshot.take(optimizer, update_tensors(optimizer, list(model.named_parameters()), 3, seed))
        checked = time.perf_counter() - started
        optimizer.step()
        started = time.perf_counter()
        report = check_update(snapshot, step=seed + 1)
        checks.append(checked + time.perf_counter() - started)
        assert report.verdict != "fail", str(report)
        excess = max(excess, report.floor_excess)
    return min(steps), min(checks), excess  # the least: a shared machine's contention only adds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print("| model | parameters | optimizer | training step | update check | in training steps | largest excess |")
    print("|---|---|---|---|---|---|---|")
    for name, build in MODELS.items():
        for label, make in OPTIMIZERS.items():
            model = build()
            count = sum(p.numel() for p in model.parameters())
            step, check, excess = _measure(model, make, args.repeats)
            print(f"| {name} | {count:,} | {label} | {step * 1e3:.2f} ms | {check * 1e3:.2f} ms | {check / step:.1f} | "
                  f"{excess:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
