"""A check's peak memory and cost against a training step's, on GPT-like models of 25M, 100M and 300M parameters (CPU).

Each measurement runs in a process of its own, so that its peak resident memory (``ru_maxrss``) is its own: a process
builds the model (``benchmarks/overhead.py``'s GPT: pre-norm blocks, tied embedding) and AdamW, trains 3 steps on a
batch of 8 × 128 tokens, and either stops there (the training step's peak) or then runs one recomputed check at
:class:`~gradwatch.GradientWatch`'s probe defaults (the check's peak: the process's peak, training included). The table
gives both peaks, their ratio, the check's extra memory in units of the float32 parameter size, and the check's time
in training steps (medians of the checks and of the steps of the same process; ``--repeats 3`` makes 3 checks
with 2 training steps between them, which a loaded machine needs for a cost figure).

Run: ``python benchmarks/memory.py`` (25M and 100M; ``--sizes 25M 100M 300M`` for all, slow on 2 cores).
"""

from __future__ import annotations

import argparse
import inspect
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SIZES = {"25M": (32000, 512, 3, 8), "100M": (32000, 768, 10, 12), "300M": (50304, 1024, 20, 16)}
"""vocabulary, width, depth, heads of each size."""


def one(size: str, check: bool, repeats: int = 1) -> dict[str, float]:
    from overhead import GPT, _lm_loss

    from gradwatch import GradientWatch, check_gradients

    torch.manual_seed(0)
    torch.set_num_threads(1)
    vocab, width, depth, heads = SIZES[size]
    net = GPT(vocab, width, depth, heads, 128)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    tokens = torch.randint(0, vocab, (8, 129))
    steps: list[float] = []

    def train(count: int) -> None:
        for _ in range(count):
            started = time.perf_counter()
            optimizer.zero_grad()
            _lm_loss(net, (tokens,)).backward()
            optimizer.step()
            steps.append(time.perf_counter() - started)

    train(3)
    result = {
        "parameters": sum(p.numel() for p in net.parameters()),
        "step_s": statistics.median(steps),
        "step_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if check:
        defaults = {
            name: p.default
            for name, p in inspect.signature(GradientWatch).parameters.items()
            if name in ("tensor_probes", "random_probes", "param_probes", "input_probes", "precision", "vectorize")
        }
        report = check_gradients(net, (tokens,), _lm_loss, step=3, probe_batch_size=2, **defaults)
        durations = [report.duration_s]
        for repeat in range(repeats - 1):  # checks and steps interleaved: a loaded machine slows both alike
            train(2)
            durations.append(check_gradients(net, (tokens,), _lm_loss, step=4 + repeat, probe_batch_size=2,
                                             **defaults).duration_s)  # fmt: skip
        train(2 if repeats > 1 else 0)
        result.update(
            step_s=statistics.median(steps),
            check_s=statistics.median(durations),
            check_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            evaluations=report.n_forward,
            verdict=str(report.verdict),
            precision=report.precision,
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["25M", "100M"], choices=list(SIZES))
    parser.add_argument("--one", choices=("step", "check"), help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=1, help="checks per process, interleaved with training steps")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.sizes[0], args.one == "check", args.repeats)))
        return
    print("| model | step peak | check peak | check / step | extra / float32 parameters | check / training step "
          "| evaluations | precision, verdict |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        runs = {}
        for kind in ("step", "check"):
            command = [sys.executable, __file__, "--one", kind, "--sizes", size, "--repeats", str(args.repeats)]
            runs[kind] = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
        step, check = runs["step"], runs["check"]
        parameters = step["parameters"]
        extra = (check["check_peak"] - step["step_peak"]) / (4 * parameters)
        peaks = f"{step['step_peak'] / 2**30:.2f} GiB | {check['check_peak'] / 2**30:.2f} GiB"
        cost = check["check_s"] / check["step_s"]
        ratios = f"{check['check_peak'] / step['step_peak']:.2f}x | {extra:.1f}x | {cost:.1f}"
        print(
            f"| GPT {parameters / 1e6:.0f}M | {peaks} | {ratios} | {check['evaluations']} | "
            f"{check['precision']}, {check['verdict']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
