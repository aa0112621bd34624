"""What a check meets on a device: float64's price there, a check's memory against the training step's, and the
checks' verdicts and cost under each training precision (TF32 off and on, bf16-mixed, 16-mixed).

Three markdown tables, for a CNN and a transformer, in a plain loop (no Lightning):

1. **float64's price**: a native and a float64 forward of the loss timed on the device (synchronised, fastest of 5),
   their ratio, and what ``precision="auto"`` chose at a check (with the note that says why, when native);
2. **memory**: the training step's peak, a check's peak (``torch.cuda.max_memory_allocated``; ``-`` on a CPU, whose
   peak is the process's) and the free memory gradwatch reads before a check;
3. **precisions**: per training precision, the training step's time without gradwatch, the time of the same steps
   with a recomputed and an applied check at every step, and the checks' verdicts (a healthy model: ``fail`` is a
   false alarm).

Run on a GPU: ``python benchmarks/gpu_checks.py --device cuda``; ``--device cpu --tiny`` is the dry run CI makes
(``bash benchmarks/gpu.sh --device cpu``), a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from gradwatch import GradientWatch, check_gradients
from gradwatch.engine.function.memory import free_memory
from gradwatch.engine.results.numerics import current_numerics


class CNN(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.Tanh(), nn.AvgPool2d(2),
            nn.Conv2d(width, width, 3, padding=1), nn.Tanh(), nn.AdaptiveAvgPool2d(4),
        )  # fmt: skip
        self.head = nn.Linear(width * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class Transformer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)).mean(1))


def _models(tiny: bool, device: torch.device) -> dict[str, tuple[nn.Module, Callable[[], Any]]]:
    width, batch = (8, 8) if tiny else (128, 64)
    side, tokens = (16, 8) if tiny else (32, 128)

    def images() -> Any:
        return torch.randn(batch, 3, side, side, device=device), torch.randint(0, 10, (batch,), device=device)

    def sequences() -> Any:
        return torch.randn(batch, tokens, 16, device=device), torch.randint(0, 10, (batch,), device=device)

    torch.manual_seed(0)
    return {"CNN": (CNN(width).to(device), images), "transformer": (Transformer(width).to(device), sequences)}


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]).float(), batch[1])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fastest(run: Callable[[], Any], device: torch.device, repeats: int = 5) -> float:
    run()  # warm-up: first calls allocate and pick kernels
    times = []
    for _ in range(repeats):
        _synchronize(device)
        started = time.perf_counter()
        run()
        _synchronize(device)
        times.append(time.perf_counter() - started)
    return min(times)


def price_table(models: dict[str, Any], device: torch.device) -> None:
    print("| model | native forward | float64 forward | ratio | precision='auto' chose | why |")
    print("|---|---|---|---|---|---|")
    for name, (model, batches) in models.items():
        batch = batches()
        double = copy.deepcopy(model).double()
        promoted = tuple(t.double() if t.is_floating_point() else t for t in batch)
        with torch.no_grad():
            native = _fastest(functools.partial(_loss, model, batch), device)
            wide = _fastest(functools.partial(_loss, double, promoted), device)
        report = check_gradients(model, batch, _loss, probe_batch_size=2)
        why = next((str(n) for n in report.notes if n.code in ("float64-too-slow", "memory-native")), "")
        print(f"| {name} | {native * 1e3:.2f} ms | {wide * 1e3:.2f} ms | {wide / native:.1f}x | {report.precision} "
              f"| {why} |")  # fmt: skip


def memory_table(models: dict[str, Any], device: torch.device) -> None:
    print("| model | step peak | check peak | free before the check | check verdict |")
    print("|---|---|---|---|---|")
    for name, (model, batches) in models.items():
        batch = batches()
        peaks = []
        for check in (False, True):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            if check:
                free = free_memory(device)
                report = check_gradients(model, batch, _loss, probe_batch_size=2)
            else:
                _loss(model, batch).backward()
                model.zero_grad(set_to_none=True)
            peaks.append(torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None)
        shown = ["-" if p is None else f"{p:.0f} MiB" for p in peaks]
        free_text = "unknown" if free is None else f"{free / 2**20:.0f} MiB"
        print(f"| {name} | {shown[0]} | {shown[1]} | {free_text} | {report.verdict} |")


@contextlib.contextmanager
def _precision(setting: str, device: torch.device) -> Iterator[None]:
    saved = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    try:
        tf32 = setting == "32-true TF32 on"
        torch.backends.cuda.matmul.fp32_precision = "tf32" if tf32 else "ieee"
        torch.backends.cudnn.conv.fp32_precision = "tf32" if tf32 else "ieee"
        dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(setting)
        with torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
            yield
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


def _train(model: nn.Module, batches: Callable[[], Any], steps: int, setting: str, device: torch.device,
           watch: GradientWatch | None) -> float:  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(device.type, enabled=setting == "16-mixed")
    _synchronize(device)
    started = time.perf_counter()
    for step in range(1, steps + 1):
        batch = batches()
        if watch is not None:
            watch.record(batch)
        with _precision(setting, device):
            loss = _loss(model, batch)
        scaler.scale(loss).backward()
        if watch is not None:
            scaler.unscale_(optimizer)
            with _precision(setting, device):
                watch.before_optimizer_step(model, _loss, step=step)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if watch is not None:
            with _precision(setting, device):
                watch.maybe_check(model, batch, _loss, step=step)
    _synchronize(device)
    return time.perf_counter() - started


def precision_table(models: dict[str, Any], device: torch.device, steps: int) -> None:
    settings = ["32-true TF32 off", "32-true TF32 on", "bf16-mixed"] + (["16-mixed"] if device.type == "cuda" else [])
    print("| model | precision | step | steps with checks at every step | recomputed verdicts | applied verdicts |")
    print("|---|---|---|---|---|---|")
    for name, (model, batches) in models.items():
        for setting in settings:
            plain = _train(copy.deepcopy(model), batches, steps, setting, device, None)
            watch = GradientWatch(every_n_steps=1, applied_every_n_steps=1, max_overhead=None, verbose=False)
            watched = _train(copy.deepcopy(model), batches, steps, setting, device, watch)
            verdicts = {scope: collections.Counter(r.verdict for r in watch.reports if r.scope == scope)
                        for scope in ("recomputed", "applied")}  # fmt: skip
            shown = {scope: ", ".join(f"{n} {v}" for v, n in sorted(c.items())) or "none" for scope, c in
                     verdicts.items()}  # fmt: skip
            print(f"| {name} | {setting} | {plain / steps * 1e3:.1f} ms | {watched / steps * 1e3:.1f} ms | "
                  f"{shown['recomputed']} | {shown['applied']} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny models and 2 steps: the CPU dry run")
    parser.add_argument("--steps", type=int, default=None, help="training steps per precision (default 10; tiny 2)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device (torch.cuda.is_available() is False)")
    device = torch.device(args.device)
    steps = args.steps or (2 if args.tiny else 10)
    models = _models(args.tiny, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}")
    print(f"numerics at start: {current_numerics().describe()}\n")
    price_table(models, device)
    print()
    memory_table(models, device)
    print()
    precision_table(models, device, steps)
    if args.tiny:
        print(f"\n(a dry run: {steps} steps per precision, single runs; its times are not figures)")


if __name__ == "__main__":
    main()
