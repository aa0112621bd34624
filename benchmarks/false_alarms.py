"""False alarms on correct models: checks at random points of six models, in float32 and float64.

    python benchmarks/false_alarms.py [--checks 30]

Each check perturbs the model's initial parameters by a random 5% (a different point every time) and runs
``check_gradients`` at the defaults. Every gradient here is correct, so every "fail" is a false alarm. Prints a
markdown table: checks, failing checks, inconclusive checks, and the probe-level verdict mix per model and dtype.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradwatch import check_gradients

Case = tuple[nn.Module, Any, Callable[[nn.Module, Any], Tensor]]


def _cross_entropy(model: nn.Module, batch: Any) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _mse(model: nn.Module, batch: Any) -> Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def seed_case(dtype: torch.dtype) -> Case:
    """The forum case: MSELoss(reduction="sum") over a 140x120 output."""
    model = nn.Linear(64, 120).to(dtype)
    batch = (torch.randn(140, 64, dtype=dtype), torch.randn(140, 120, dtype=dtype))
    return model, batch, lambda m, b: nn.MSELoss(reduction="sum")(m(b[0]), b[1])


def relu_mlp(dtype: torch.dtype) -> Case:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(dtype)
    return model, (torch.randn(64, 32, dtype=dtype), torch.randint(0, 10, (64,))), _cross_entropy


def tanh_mlp(dtype: torch.dtype) -> Case:
    model = nn.Sequential(nn.Linear(20, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, 1)).to(dtype)
    return model, (torch.randn(128, 20, dtype=dtype), torch.randn(128, 1, dtype=dtype)), _mse


def cnn(dtype: torch.dtype) -> Case:
    """BatchNorm, ReLU, max-pool and dropout: kinks, ties, a bias with zero true gradient, random masks."""
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.2),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 10),
    ).to(dtype)
    return model, (torch.randn(16, 3, 16, 16, dtype=dtype), torch.randint(0, 10, (16,))), _cross_entropy


class _Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 32)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.head = nn.Linear(32, 50)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.layer(self.embedding(tokens))).reshape(-1, 50)


def transformer(dtype: torch.dtype) -> Case:
    """An embedding input (integer tokens: no input probes), attention, dropout, LayerNorm."""
    tokens, targets = torch.randint(0, 50, (8, 12)), torch.randint(0, 50, (8, 12))
    return _Transformer().to(dtype), (tokens, targets.reshape(-1)), _cross_entropy


class _LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lstm(x)[0][:, -1])


def lstm(dtype: torch.dtype) -> Case:
    return _LSTM().to(dtype), (torch.randn(16, 10, 8, dtype=dtype), torch.randn(16, 1, dtype=dtype)), _mse


CASES = [seed_case, relu_mlp, tanh_mlp, cnn, transformer, lstm]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checks", type=int, default=30, help="checks per model and dtype")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)

    print("| dtype | model | checks | failing checks | inconclusive checks | probes ok / inconclusive / fail | s |")
    print("|---|---|---:|---:|---:|---|---:|")
    totals = collections.Counter()
    for dtype in (torch.float32, torch.float64):
        for build in CASES:
            verdicts: collections.Counter[str] = collections.Counter()
            probes: collections.Counter[str] = collections.Counter()
            started = time.perf_counter()
            for k in range(args.checks):
                torch.manual_seed(k)
                model, batch, loss_fn = build(dtype)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.05 * torch.randn_like(p) * (p.pow(2).mean().sqrt() + 1e-2))
                report = check_gradients(model, batch, loss_fn, step=k)
                verdicts[report.verdict] += 1
                probes.update(p.verdict for p in report.probes)
            totals.update({f"{dtype}-{v}": n for v, n in verdicts.items()})
            print(
                f"| {str(dtype).removeprefix('torch.')} | {build.__name__} | {args.checks} | {verdicts['fail']} | "
                f"{verdicts['inconclusive']} | {probes['ok']} / {probes['inconclusive']} / {probes['fail']} | "
                f"{time.perf_counter() - started:.1f} |"
            )
    for dtype in ("torch.float32", "torch.float64"):
        checks = sum(n for key, n in totals.items() if key.startswith(dtype))
        print(
            f"\n{dtype.removeprefix('torch.')}: {checks} checks, {totals[f'{dtype}-fail']} failing (false alarms), "
            f"{totals[f'{dtype}-inconclusive']} inconclusive"
        )


if __name__ == "__main__":
    main()
