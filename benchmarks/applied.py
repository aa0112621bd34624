"""The applied-gradient check (issue 23): planted path faults, the noise floor per precision, and the cost.

Usage: ``python benchmarks/applied.py [--seeds N] [--steps N]`` (CPU, a few minutes). Prints three markdown tables:

1. **planted faults**: each fault on the training's path only, the first applied check that caught it, the fault it
   named, the loss evaluations and backward passes the check took (attribution included);
2. **noise floor** per model and precision: the measured floor along the applied gradient relative to ``‖g‖`` (median
   and largest over seeds), the storage rounding of the precision for comparison, and the largest discrepancy of a
   healthy check in units of its tolerance (a failure needs more than 1);
3. **cost** per model and precision: one applied check in training steps (an optimizer step of the same model, batch
   and precision, timed the same way), its loss evaluations, and what the default cadence
   (``applied_every_n_steps``) costs before the budget.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from applied_models import (
    CNN,
    MLP,
    ChannelsLastPool,
    Transformer,
    batch_for,
    bf16,
    cross_entropy,
    scaled_once,
    train_window,
)

from gradwatch.engine.applied import AppliedWindow, check_applied_gradient
from gradwatch.engine.applied.verdict import storage_rounding
from gradwatch.lightning.applied import DEFAULT_APPLIED_EVERY_N_STEPS

MODELS = {"MLP": MLP, "CNN (BatchNorm, dropout)": CNN, "transformer (dropout)": Transformer}
PATHS: dict[str, Any] = {"32-true": None, "bf16-mixed": bf16}


def _precision(model: torch.nn.Module) -> Any:
    window = train_window(model, [batch_for(model, seed=1), batch_for(model, seed=2)], bf16)
    return window.check(cross_entropy, path=bf16)


def _accumulation(model: torch.nn.Module) -> Any:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_window(model, [batch_for(model, seed=1)])
    optimizer.step()
    return train_window(model, [batch_for(model, seed=2)], zero=False).check(cross_entropy)


def _mis_summed(model: torch.nn.Module) -> Any:
    window = AppliedWindow(model)
    model.zero_grad()
    for seed in (1, 2, 3):
        batch = batch_for(model, seed=seed)
        window.record(batch)
        cross_entropy(model, batch).backward()
    return window.check(cross_entropy, combine="mean")


def _transient(model: torch.nn.Module) -> Any:
    with scaled_once(model.fc1.weight, 3.0):  # type: ignore[arg-type]
        return train_window(model, [batch_for(model, seed=1), batch_for(model, seed=2)]).check(cross_entropy)


def _formula(model: torch.nn.Module) -> Any:
    handle = model.fc2.weight.register_hook(lambda grad: grad * 1.02)  # type: ignore[union-attr, operator]
    try:
        return train_window(model, [batch_for(model, seed=1)]).check(cross_entropy)
    finally:
        handle.remove()


def _compiled(model: torch.nn.Module) -> Any:
    compiled = torch.compile(model)
    batches = [batch_for(model, seed=1)]
    window = train_window(model, batches, forward=compiled)
    return check_applied_gradient(compiled, batches, cross_entropy, rng_states=window.rng_states)


FAULTS = [
    ("custom Function wrong only under bf16 autocast (x1.5)", "precision", lambda: MLP(autocast_fault=1.5), _precision),
    ("gradients not zeroed between windows", "accumulation", MLP, _accumulation),
    ("3 micro-batches summed, loss is their mean", "accumulation", MLP, _mis_summed),
    ("hook scales fc1.weight x3 once", "transient", MLP, _transient),
    ("hook scales fc2.weight x1.02 always", "formula", MLP, _formula),
    ("adaptive_max_pool3d channels-last, compiled (pytorch#197888)", "compiled", ChannelsLastPool, _compiled),
]


def planted() -> None:
    print("| planted fault (on the path only) | expected | caught at check | fault named | evaluations | backward |")
    print("|---|---|---|---|---|---|")
    for name, expected, make, run in FAULTS:
        torch.manual_seed(0)
        report = run(make())
        caught = "1st" if report.verdict == "fail" else "no"
        print(f"| {name} | {expected} | {caught} | {report.fault} | {report.n_forward} | {report.n_backward} |")
    print("\n(DDP communication hook scaling a bucket: `reduction`, tests/lightning/test_ddp_applied.py)\n")


def floors(seeds: int) -> None:
    print("| model | precision | floor / ‖g‖ median | floor / ‖g‖ max | storage rounding | worst healthy excess |")
    print("|---|---|---|---|---|---|")
    for name, make in MODELS.items():
        for precision, path in PATHS.items():
            values, excess = [], []
            for seed in range(seeds):
                torch.manual_seed(seed)
                model = make()
                window = train_window(model, [batch_for(model, seed=10 * seed + s) for s in (1, 2)], path)
                report = window.check(cross_entropy, path=path, culprit_search=False)
                assert report.verdict == "ok", str(report)
                values.append(report.noise_floor)
                excess.append(report.floor_excess)
            rounding = storage_rounding(torch.bfloat16 if path else torch.float32)
            print(
                f"| {name} | {precision} | {statistics.median(values):.2e} | {max(values):.2e} | {rounding:.2e} "
                f"| {max(excess):.2f} |"
            )
    print()


def _seconds(function: Any, repeats: int) -> float:
    function()  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - started) / repeats


def cost(steps: int) -> None:
    print("| model | precision | training step (ms) | applied check (ms) | in training steps | evaluations "
          f"| default cadence ({DEFAULT_APPLIED_EVERY_N_STEPS}) before the budget |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, make in MODELS.items():
        for precision, path in PATHS.items():
            torch.manual_seed(0)
            model = make()
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            batch = batch_for(model, size=64, seed=1)

            def step(
                model: torch.nn.Module = model, path: Any = path, batch: Any = batch, optimizer: Any = optimizer
            ) -> None:
                optimizer.zero_grad()
                with path() if path is not None else torch.autocast("cpu", enabled=False):
                    loss = cross_entropy(model, batch)
                loss.backward()
                optimizer.step()

            step_s = _seconds(step, steps)
            window = train_window(model, [batch], path)
            reports: list[Any] = []
            check_s = _seconds(lambda w=window, p=path, r=reports: r.append(w.check(cross_entropy, path=p)), 3)
            ratio = check_s / step_s
            print(
                f"| {name} | {precision} | {step_s * 1e3:.1f} | {check_s * 1e3:.0f} | {ratio:.1f} "
                f"| {reports[-1].n_forward} | {ratio / DEFAULT_APPLIED_EVERY_N_STEPS:.2%} |"
            )
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    options = parser.parse_args()
    torch.set_num_threads(1)
    planted()
    floors(options.seeds)
    cost(options.steps)


if __name__ == "__main__":
    main()
