"""Detection latency in a deep model: checks until the first failure for a 2% backward bug in one deep tensor.

A 12-layer Llama-like decoder (``tests/deep_models.py``: RMSNorm, causal attention, SwiGLU MLP, random init, synthetic
tokens) trains with AdamW under ``GradientWatch(every_n_steps=2, max_overhead=None)``: a recomputed check every 2
optimizer steps at the watch's defaults. The bug scales one module's weight gradient by 1.02 (attention q and o
projections, MLP up and down projections, a norm weight, the embedding), or with ``--input`` the gradient its backward
passes to its input. For each, the table gives the checks until the first failure (at most ``--checks``) and the culprit
named then, judged against the module at fault: **right** (that module or one inside it), **container** (a module
containing it: less specific, still true) or **wrong** (any other module). A correct model's checks show the healthy
cost and that none fails.

Run: ``python benchmarks/deep_detection.py`` (a few minutes on 2 CPU cores; ``--checks 3`` for a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from deep_models import DEEP_TENSORS, deep_llama, language_model_loss, token_batches
from watched_runs import first_check_with

from gradwatch import CheckReport
from gradwatch.engine.culprits.search import LOSS


def judged(culprits: list[str], module: str) -> str:
    """The named culprit against the module at fault (see the module doc)."""
    if not culprits:
        return "none"
    named = culprits[0]
    if named == module or named.startswith(f"{module}."):
        return "right"
    if named != LOSS and (named == "" or module.startswith(f"{named}.")):
        return "container"
    return "wrong"


def run(
    bug_at: str | None, wrong_input: bool, checks: int, seed: int = 0
) -> tuple[int | None, CheckReport | None, list[int]]:
    """Train under the watch until the first failing check or ``checks`` checks; the failing check's position, its
    report, and the loss evaluations of every healthy check."""
    model = deep_llama(bug_at, seed=seed, wrong_input=wrong_input)
    batches = token_batches(2 * checks + 2, seed=seed)
    return first_check_with(model, batches, language_model_loss, lr=1e-3, checks=checks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", type=int, default=10, help="the most checks per run")
    parser.add_argument("--input", action="store_true", help="the bug in the input gradient, not the weight's")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    where = "input gradient" if args.input else "weight gradient"
    model = "12-layer Llama-like model, GradientWatch(every_n_steps=2, max_overhead=None)"
    print(f"## A 2% bug in one deep tensor's {where}: {model}\n")
    print("| bug in | checks until the first failure | culprit named | judged | loss evaluations (failing check) | s |")
    print("|---|---|---|---|---|---|")
    for module in DEEP_TENSORS:
        if args.input and module == "embed_tokens":
            continue  # token ids: no input gradient to get wrong
        started = time.perf_counter()
        first, report, _ = run(module, args.input, args.checks)
        seconds = time.perf_counter() - started
        if report is None:
            print(f"| `{module}` | not within {args.checks} | - | - | - | {seconds:.0f} |")
            continue
        named = f"`{report.culprits[0]}`" if report.culprits else "-"
        verdict = judged(report.culprits, module)
        print(f"| `{module}` | {first} | {named} | {verdict} | {report.n_forward} | {seconds:.0f} |")
    started = time.perf_counter()
    first, _, healthy = run(None, False, args.checks)
    seconds = time.perf_counter() - started
    print(
        f"\ncorrect model: {len(healthy)} checks, {'none failed' if first is None else f'check {first} FAILED'}, "
        f"{statistics.mean(healthy):.1f} loss evaluations per check (max {max(healthy)}), "
        f"{1e3 * seconds / max(len(healthy), 1):.0f} ms per check with its 2 training steps"
    )


if __name__ == "__main__":
    main()
