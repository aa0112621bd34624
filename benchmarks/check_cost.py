"""What one gradient check costs, against one training step of the same model on the same batch.

    python benchmarks/check_cost.py [--repeats 20] [--threads 2]

Prints a markdown table: median time of a training step (forward, backward, SGD step), of one check at the default
settings, their ratio, the forwards a check spends, and the same check without float64 reductions (the cost of the
torch-function mode that accumulates the loss's final reductions in float64).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from models import CustomNormClassifier, HealthyClassifier, synthetic_classification

from gradwatch import check_gradients


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cases() -> list[tuple[str, nn.Module, Any, Callable[[nn.Module, Any], Tensor]]]:
    dataset = synthetic_classification()
    classify = (dataset.tensors[0][:64], dataset.tensors[1][:64])

    def cross_entropy(model: nn.Module, batch: Any) -> Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    torch.manual_seed(0)
    seed = nn.Linear(64, 120)
    seed_batch = (torch.randn(140, 64), torch.randn(140, 120))

    def seed_loss(model: nn.Module, batch: Any) -> Tensor:
        return nn.MSELoss(reduction="sum")(model(batch[0]), batch[1])

    return [
        ("demo: HealthyClassifier, batch 64", HealthyClassifier(), classify, cross_entropy),
        ("demo: CustomNormClassifier, batch 64", CustomNormClassifier(), classify, cross_entropy),
        ("seed case: Linear 64->120, sum MSE 140x120", seed, seed_batch, seed_loss),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, median of {args.repeats}\n")
    print(
        "| model | train step (ms) | check (ms) | check / step | forwards per check "
        "| check without float64 reductions (ms) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, model, batch, loss_fn in _cases():
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

        def train_step(
            model: nn.Module = model, batch: Any = batch, loss_fn: Any = loss_fn, opt: Any = optimizer
        ) -> None:
            opt.zero_grad()
            loss_fn(model, batch).backward()
            opt.step()

        step = _median_seconds(train_step, args.repeats)
        check = _median_seconds(lambda m=model, b=batch, f=loss_fn: check_gradients(m, b, f), args.repeats)
        native = _median_seconds(
            lambda m=model, b=batch, f=loss_fn: check_gradients(m, b, f, float64_reductions=False), args.repeats
        )
        forwards = check_gradients(model, batch, loss_fn).n_forward
        print(
            f"| {name} | {step * 1e3:.2f} | {check * 1e3:.1f} | {check / step:.1f}x | {forwards} | {native * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
