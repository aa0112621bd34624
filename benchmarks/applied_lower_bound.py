"""The least a healthy applied check with float64 probes can cost, per benchmark model, in training steps.

A healthy applied check of a float32 model is, at the least, the window's float32 forward and backward (its eager
gradient: the unnamed-autocast inference and the attribution need it) and two float64 screens of two points each (the
descent and the ``"tensors"`` probe, :mod:`gradwatch.engine.applied.probes`): one backward and four float64 forwards
of the whole window. This script times those parts on the models of ``benchmarks/applied.py``'s cost table and of
``benchmarks/overhead.py --short`` (a plain loop, AdamW, one thread, medians) and prints that lower bound next to the
training step. Where it is above 5 steps, no choice of probes within this design reaches issue 33's target; where the
bound is far below the measured check, the rest is the check's own Python cost.

Run: ``python benchmarks/applied_lower_bound.py`` (about a minute on one CPU core).
"""

from __future__ import annotations

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

Loss = Callable[[nn.Module, Any], torch.Tensor]


def _median_ms(function: Callable[[], Any], repeats: int) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def _image_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _cases() -> list[tuple[str, nn.Module, Any, Loss, int]]:
    cases: list[tuple[str, nn.Module, Any, Loss, int]] = []
    for name, make in (("MLP", MLP), ("CNN (BatchNorm, dropout)", CNN), ("transformer (dropout)", Transformer)):
        torch.manual_seed(0)
        model = make()
        cases.append((f"{name}, `applied.py`, batch 64", model, batch_for(model, size=64, seed=1), cross_entropy, 50))
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    images = (torch.randn(128, 3, 32, 32, generator=generator), torch.randint(0, 10, (128,), generator=generator))
    cases.append(("CNN, `overhead.py`, batch 128", overhead.CNN(), images, _image_loss, 5))
    tokens = (torch.randint(0, 512, (32, 65), generator=generator),)
    gpt = overhead.GPT(512, 128, 2, 4, 64)
    cases.append(("GPT LM, `overhead.py`, 32 x 64 tokens", gpt, tokens, overhead._lm_loss, 10))
    return cases


def main() -> None:
    torch.set_num_threads(1)
    print("| model | training step (ms) | float32 forward and backward | float64 forward | float64 forward / step "
          "| least healthy check: 1 backward + 4 float64 forwards, in training steps |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, model, batch, loss, repeats in _cases():
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(model: nn.Module = model, batch: Any = batch, loss: Loss = loss, optimizer: Any = optimizer) -> None:
            optimizer.zero_grad()
            loss(model, batch).backward()
            optimizer.step()

        def backward(model: nn.Module = model, batch: Any = batch, loss: Loss = loss) -> None:
            loss(model, batch).backward()

        precise = copy.deepcopy(model).double()
        precise_batch = tuple(t.double() if t.is_floating_point() else t for t in batch)
        step_ms = _median_ms(step, repeats)
        backward_ms = _median_ms(backward, repeats)
        with torch.no_grad():
            float64_ms = _median_ms(lambda m=precise, b=precise_batch, f=loss: f(m, b), repeats)
        least = (backward_ms + 4 * float64_ms) / step_ms
        print(f"| {name} | {step_ms:.2f} | {backward_ms:.2f} | {float64_ms:.2f} | {float64_ms / step_ms:.2f} "
              f"| {least:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
