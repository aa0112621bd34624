"""A healthy applied check against its lower bound, float32 and bf16-mixed, both measured in the same run.

For each model of the cost tables (``benchmarks/applied.py``'s MLP, CNN with BatchNorm and dropout, and transformer,
batch 64; ``benchmarks/overhead.py``'s CIFAR CNN, batch 128, and GPT LM, 32 × 64 tokens), a plain loop with AdamW
trains one micro-batch per step, float32 or under CPU autocast to bfloat16 (``bf16-mixed``), with a
:class:`gradwatch.GradientWatch` at its defaults but an applied check at every step (``applied_every_n_steps=1``, no
budget, no recomputed check, no update check): the calls an adapter makes around the optimizer step
(``watch.record`` before the forward, ``watch.before_optimizer_step`` after the backward). Interleaved with those
steps, in the same process, one thread, CPU time of the thread (``time.thread_time``), it times

* **the training step** (``zero_grad``, forward and backward on the path, ``optimizer.step``);
* **the check**: one ``before_optimizer_step`` call that runs a healthy applied check;
* **the bound**: the numerical work the check cannot do without, each piece timed as a bare PyTorch call of the same
  window (no gradwatch code in it):

  - float32: one float32 forward and ``torch.autograd.grad`` of the window (the eager gradient) and four float64
    forwards (the descent and ``"tensors"`` screens, two points each): issue 41's bound, 1 backward + 4 float64
    forwards;
  - bf16-mixed: the eager float32 forward and backward, two forward and backward passes on the bf16 autocast path
    (the path's gradient and the same of the loss scaled, whose spread is half of a 16-bit floor), one more float32
    forward and backward standing for the float32 pass with autocast's rounding emulated (a bare float32 pass is less
    than that pass can cost), and the check's own float64 evaluations as float64 forwards (a 16-bit path's floors add
    up along a combined direction, so its design probes most tensors on their own: the count is the check's, not
    four).

Medians over the timed rounds (the first checks are left out: the watch's first check looks closer by design). The
ratio is check / bound; the loss evaluations are the check's ``report.n_forward`` (the reference's float32 forward and
its float64 evaluations). The last column holds the check against the same bare work for the passes it made (a
float32 check that takes a closer look makes more than four float64 evaluations, and a float64 backward for its
floor): what is left there is the check's own Python.

Run: ``OMP_NUM_THREADS=1 python benchmarks/applied_cost.py [--rounds 7] [--only MLP]`` (a few minutes).
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

from gradwatch import GradientWatch

Loss = Callable[[nn.Module, Any], torch.Tensor]
WARM_CHECKS = 2
"""Checks made before timing: the watch's first check looks closer by design, and the kernels warm up."""


def _image_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def cases() -> list[tuple[str, Callable[[], nn.Module], Any, Loss]]:
    """The models of the cost tables, each with its batch and loss."""
    found: list[tuple[str, Callable[[], nn.Module], Any, Loss]] = []
    for name, make in (("MLP", MLP), ("CNN (BatchNorm, dropout)", CNN), ("transformer (dropout)", Transformer)):
        found.append((f"{name}, batch 64", make, batch_for(make(), size=64, seed=1), cross_entropy))
    generator = torch.Generator().manual_seed(0)
    images = (torch.randn(128, 3, 32, 32, generator=generator), torch.randint(0, 10, (128,), generator=generator))
    found.append(("CIFAR CNN, `overhead.py`, batch 128", overhead.CNN, images, _image_loss))
    tokens = (torch.randint(0, 512, (32, 65), generator=generator),)
    found.append(("GPT LM, `overhead.py`, 32 × 64 tokens", lambda: overhead.GPT(512, 128, 2, 4, 64), tokens,
                  overhead._lm_loss))  # fmt: skip
    return found


def _bf16() -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _timed(function: Callable[[], Any]) -> tuple[float, Any]:
    started = time.thread_time()
    result = function()
    return time.thread_time() - started, result


class Case:
    """One model on one path: its loop with a watch, and the bare passes of its bound."""

    def __init__(self, make: Callable[[], nn.Module], batch: Any, loss: Loss, path: Callable[[], Any] | None) -> None:
        torch.manual_seed(0)
        self.model, self.batch, self.loss, self.path = make(), batch, loss, path
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.watch = GradientWatch(every_n_steps=10**9, first_check_step=None, applied_every_n_steps=1,
                                   max_overhead=None, check_update=False, verbose=False)  # fmt: skip
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.steps = 0

    def _context(self) -> Any:
        return self.path() if self.path is not None else torch.autocast("cpu", enabled=False)

    def step(self) -> None:
        """A training step without the watch."""
        self.optimizer.zero_grad()
        with self._context():
            value = self.loss(self.model, self.batch)
        value.backward()
        self.optimizer.step()
        self.steps += 1

    def watched(self) -> tuple[float, Any]:
        """A training step with the watch: the CPU time of its ``before_optimizer_step`` and its report."""
        self.steps += 1
        self.optimizer.zero_grad()
        self.watch.record(self.batch, model=self.model, step=self.steps)
        with self._context():
            value = self.loss(self.model, self.batch)
        value.backward()
        seconds, report = _timed(
            lambda: self.watch.before_optimizer_step(self.model, self.loss, step=self.steps, path=self.path)
        )
        self.optimizer.step()
        return seconds, report

    def backward(self, path: Callable[[], Any] | None = None) -> None:
        """One forward and ``torch.autograd.grad`` of the window, on ``path`` (eager float32 without one)."""
        with path() if path is not None else torch.autocast("cpu", enabled=False):
            value = self.loss(self.model, self.batch)
        torch.autograd.grad(value, self.params)

    def float64_forward(self) -> Callable[[], None]:
        """One float64 forward of the window, on a float64 copy of the model at its current parameters."""
        precise = copy.deepcopy(self.model).double()
        batch = tuple(t.double() if t.is_floating_point() else t for t in self.batch)

        def forward() -> None:
            with torch.no_grad():
                self.loss(precise, batch)

        return forward

    def float64_backward(self) -> Callable[[], None]:
        """One float64 forward and ``torch.autograd.grad`` of the window, on a float64 copy of the model."""
        precise = copy.deepcopy(self.model).double()
        batch = tuple(t.double() if t.is_floating_point() else t for t in self.batch)
        params = [p for p in precise.parameters() if p.requires_grad]
        return lambda: torch.autograd.grad(self.loss(precise, batch), params) and None


def bound(case: Case, report: Any) -> tuple[float, float]:
    """The bound's CPU seconds (see the module doc), its pieces timed now; and the same bare work for the passes this
    check made (its float64 evaluations, and the float64 backward of a float32 check's lazy floor)."""
    float64 = case.float64_forward()
    float64()  # warm-up
    eager, _ = _timed(case.backward)
    forward, _ = _timed(float64)
    evaluations = report.n_forward - 1  # the first is the reference's float32 forward
    if case.path is None:
        own = eager + evaluations * forward
        if report.n_backward > 1:  # the float64 gradient of the lazy floor
            own += (report.n_backward - 1) * _timed(case.float64_backward())[0]
        return eager + 4 * forward, own
    path = sum(_timed(lambda: case.backward(case.path))[0] for _ in range(2))
    emulated, _ = _timed(case.backward)
    least = eager + path + emulated + evaluations * forward
    return least, least


def measure(case: Case, rounds: int) -> dict[str, Any]:
    """The medians of ``rounds`` interleaved rounds (step, check, bound), after :data:`WARM_CHECKS` checks."""
    for _ in range(WARM_CHECKS):
        case.step()
        case.watched()
    steps, checks, bounds, owns, evaluations = [], [], [], [], []
    for _ in range(rounds):
        steps.append(_timed(case.step)[0])
        seconds, report = case.watched()
        assert report is not None
        assert report.verdict == "ok", str(report)
        checks.append(seconds)
        evaluations.append(report.n_forward)
        least, own = bound(case, report)
        bounds.append(least)
        owns.append(own)
    return {
        "step": statistics.median(steps),
        "check": statistics.median(checks),
        "bound": statistics.median(bounds),
        "own": statistics.median([c / o for c, o in zip(checks, owns, strict=True)]),
        "evaluations": statistics.median(evaluations),
        "range": (min(evaluations), max(evaluations)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", help="only the models whose name contains this")
    options = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | precision | training step (ms) | bound (ms) | check (ms) | bound in steps | check in steps "
          "| check / bound | loss evaluations | check / its own passes |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, make, batch, loss in cases():
        if options.only and options.only not in name:
            continue
        for precision, path in (("float32", None), ("bf16-mixed", _bf16)):
            figures = measure(Case(make, batch, loss, path), options.rounds)
            step, check, least = figures["step"], figures["check"], figures["bound"]
            low, high = figures["range"]
            counts = f"{figures['evaluations']:g}" + (f" ({low}-{high})" if low != high else "")
            print(f"| {name} | {precision} | {step * 1e3:.2f} | {least * 1e3:.2f} | {check * 1e3:.2f} "
                  f"| {least / step:.1f} | {check / step:.1f} | **{check / least:.2f}×** | {counts} "
                  f"| {figures['own']:.2f}× |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
