"""A healthy applied check's peak memory against a training step's, on small-batch models (float32 and bf16).

Issue 41 asks for a check's peak within 1.5x a training step's at 26-307M parameters with small batches, where the
check's copies weigh more than a step's activations. Each row runs in a process of its own: it builds the model
(random init, synthetic data made on the spot), trains 2 steps with AdamW (its state allocated), then samples the
process's resident memory every millisecond by a thread through a third training step and through one
:func:`gradwatch.check_applied_gradient` (``culprit_search=False``) of the next step's gradient. Both peaks are taken
above the same baseline (torch imported, before the model is built). ``MALLOC_MMAP_THRESHOLD_=65536`` is set for the
child processes, so that freed tensors leave the resident count. Models:

* ``mlp``: 512 -> 2048, five 2048 x 2048 tanh layers, 16 classes, batch 32 (22M parameters);
* ``embedding``: a 32000 x 512 embedding, one 512 x 512 tanh layer and a 512 -> 32000 head, batch 32 (33M);
* ``gpt-25M`` / ``gpt-100M``: ``benchmarks/memory.py``'s GPTs, dropout off, 4 sequences of 128 tokens (26M, 96M).

``bf16`` is the training step under CPU autocast to bfloat16 (the check's ``path``).

Run: ``python benchmarks/applied_memory.py [--models mlp embedding gpt-25M gpt-100M] [--precisions float32 bf16]``
(a few minutes on one CPU core; the GPT 96M rows need about 4 GB).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resident import PeakResident, resident

MODELS = ("mlp", "embedding", "gpt-25M", "gpt-100M")


def _build(name: str) -> tuple[Any, Any, Callable[[Any, Any], Any]]:
    """The model, its batch and its loss."""
    import torch
    from torch import nn

    if name.startswith("gpt"):
        from memory import SIZES
        from overhead import GPT, _lm_loss

        vocab, width, depth, heads = SIZES[name.removeprefix("gpt-")]
        model = GPT(vocab, width, depth, heads, 128)
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
            if isinstance(module, nn.MultiheadAttention):
                module.dropout = 0.0
        return model, (torch.randint(0, vocab, (4, 129)),), _lm_loss
    if name == "embedding":
        model = nn.Sequential(nn.Embedding(32000, 512), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 32000))
        batch = (torch.randint(0, 32000, (32,)), torch.randint(0, 32000, (32,)))
    else:
        layers: list[nn.Module] = [nn.Linear(512, 2048), nn.Tanh()]
        for _ in range(5):
            layers += [nn.Linear(2048, 2048), nn.Tanh()]
        model = nn.Sequential(*layers, nn.Linear(2048, 16))
        batch = (torch.randn(32, 512), torch.randint(0, 16, (32,)))
    return model, batch, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])


def one(name: str, precision: str) -> dict[str, Any]:
    """One row, in this process."""
    import torch

    import gradwatch

    baseline = resident()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, batch, loss_fn = _build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def path() -> contextlib.AbstractContextManager[Any]:
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    def backward() -> None:
        optimizer.zero_grad(set_to_none=False)
        with path():
            loss = loss_fn(model, batch)
        loss.backward()

    for _ in range(2):
        backward()
        optimizer.step()
    with PeakResident(0.001) as step:
        backward()
        optimizer.step()
    backward()
    with PeakResident(0.001) as check:
        report = gradwatch.check_applied_gradient(
            model, [batch], loss_fn, path=path if precision == "bf16" else None, culprit_search=False
        )
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "step": step.peak - baseline,
        "check": check.peak - baseline,
        "verdict": str(report.verdict),
        "evaluations": report.n_forward,
        "probes": report.precision,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--precisions", nargs="+", default=["float32", "bf16"], choices=("float32", "bf16"))
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "PRECISION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    print("| model | parameters | precision | step peak (MB) | check peak (MB) | check / step | verdict "
          "| probes, evaluations |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        for precision in args.precisions:
            command = [sys.executable, __file__, "--one", name, precision]
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode:
                print(f"| {name} | | {precision} | failed: {done.stderr.strip().splitlines()[-1:]} | | | | |")
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"| {name} | {row['parameters'] / 1e6:.1f}M | {precision} | {row['step'] / 1e6:.0f} | "
                  f"{row['check'] / 1e6:.0f} | **{row['check'] / row['step']:.2f}x** | {row['verdict']} | "
                  f"{row['probes']}, {row['evaluations']} |")  # fmt: skip
            sys.stdout.flush()


if __name__ == "__main__":
    main()
