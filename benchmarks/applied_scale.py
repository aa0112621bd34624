"""One applied check's cost in training steps on a 26M-parameter GPT (CPU), at each entry point's defaults.

The applied check evaluates the window's loss (every micro-batch) at a few points, so its cost grows with the window,
not with the probe batch. This builds ``benchmarks/overhead.py``'s GPT at ``benchmarks/memory.py``'s 25M size
(dropout 0.1: the check replays the draws), trains a few optimizer steps of 2 micro-batches of 4 × 128 tokens with
AdamW, and times, in CPU time of one thread (robust to a loaded machine), one training step (both backward passes
and the optimizer's step) against one applied check made

* by :func:`gradwatch.check_applied_gradient` at its defaults, and
* by :class:`gradwatch.GradientWatch` at its defaults (``watch.record`` / ``watch.before_optimizer_step``, the first
  applied check at step 1), which is what the Lightning and Hugging Face adapters run.

Run: ``python benchmarks/applied_scale.py [--repeats 3]`` (medians over the repeats).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory import SIZES
from overhead import GPT, _lm_loss

from gradwatch import GradientWatch, check_applied_gradient
from gradwatch.engine.function.state import capture_rng


def _cpu() -> float:
    return time.process_time()


def run(repeats: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    vocab, width, depth, heads = SIZES["25M"]
    net = GPT(vocab, width, depth, heads, 128)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    windows = [[(torch.randint(0, vocab, (4, 129)),) for _ in range(2)] for _ in range(repeats + 2)]
    figures: dict[str, list[float]] = {"step": [], "engine": [], "watch": [], "evaluations": [], "watched": []}

    def backward(window: list) -> list:
        optimizer.zero_grad()
        states = []
        for batch in window:
            states.append(capture_rng())  # the GPT's dropout draws replayed by the check
            (_lm_loss(net, batch) / len(window)).backward()
        return states

    for index, window in enumerate(windows):
        started = _cpu()
        backward(window)
        optimizer.step()
        figures["step"].append(_cpu() - started)
        if index < 2:
            continue
        states = backward(window)
        started = _cpu()
        report = check_applied_gradient(net, window, _lm_loss, rng_states=states, step=index)
        figures["engine"].append(_cpu() - started)
        figures["evaluations"].append(report.n_forward)
        assert report.verdict != "fail", str(report)
        watch = GradientWatch(every_n_steps=10**6, max_overhead=None, first_check_step=None, applied_every_n_steps=1)
        optimizer.zero_grad()
        for batch in window:
            watch.record(batch, step=1)
            (_lm_loss(net, batch) / len(window)).backward()
        started = _cpu()
        watched = watch.before_optimizer_step(net, _lm_loss, step=1)
        figures["watch"].append(_cpu() - started)
        assert watched is not None
        figures["watched"].append(watched.n_forward)
        assert watched.verdict != "fail", str(watched)
    optimizer.zero_grad()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    figures = run(args.repeats)
    step = statistics.median(figures["step"])
    parameters = sum(p.numel() for p in GPT(*SIZES["25M"], 128).parameters())
    print(f"GPT {parameters / 1e6:.0f}M, 2 micro-batches of 4 x 128 tokens, one thread, CPU time, medians of "
          f"{args.repeats}: training step {step * 1e3:.0f} ms\n")  # fmt: skip
    print("| entry point | applied check, ms | training steps | loss evaluations |")
    print("|---|---|---|---|")
    # each entry point checks its own backward of the window (the watch's with new dropout draws): their probes differ
    rows = (
        ("`check_applied_gradient` defaults", "engine", "evaluations"),
        ("`GradientWatch` defaults", "watch", "watched"),
    )
    for name, key, counted in rows:
        cost = statistics.median(figures[key])
        print(f"| {name} | {cost * 1e3:.0f} | {cost / step:.1f} | {statistics.median(figures[counted]):.0f} |")


if __name__ == "__main__":
    main()
