"""Pure 16-bit models (parameters in bfloat16 or float16, no autocast): healthy checks' inconclusive rate and the checks
until a 5% bug in a 16-bit-only kernel is caught.

Three models of ``tests/low_precision_models.py``, random init, synthetic data, ``model.to(dtype)``: a small Llama-like
decoder (RMSNorm through a hand-written autograd kernel, causal attention, GELU MLP), a CNN (convolutions, BatchNorm,
ReLU, max-pool) and an MLP (ReLU, GELU), the last two with their ReLU through a hand-written kernel. Each trains with
AdamW (``eps=1e-4``); a recomputed check runs every 2 optimizer steps at ``check_gradients``' defaults. The bug makes
the kernel's backward 5% off for 16-bit inputs only (its float32 and float64 evaluations are right): every norm of the
decoder, the second ReLU of the CNN, the first of the MLP. The table gives, per model, dtype and seed, the healthy
checks' verdicts, the tolerances the checks measured, and the check at which the buggy model first failed (at most
``--checks``); ``--fixed`` judges against the fixed 16-bit tolerance instead, as before the floor was measured.

Run: ``python benchmarks/low_precision.py`` (about 6 minutes on 2 CPU cores), ``--checks 3 --seeds 1`` for a smoke run,
``--models cnn`` for one model.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from low_precision_models import (
    classifier_loss,
    decoder_loss,
    image_batches,
    sixteen_bit_classifier,
    sixteen_bit_decoder,
    token_batches,
)

from gradwatch import CheckReport, check_gradients
from gradwatch.engine.numerics.steps import relative_tolerance

MODELS = ("decoder", "cnn", "mlp")


def run(
    kind: str, dtype: torch.dtype, factor: float, checks: int, seed: int, fixed: bool, stop: bool
) -> list[CheckReport]:
    """Train, checking every 2 steps; with ``stop``, until the first failure."""
    if kind == "decoder":
        model, loss_fn = sixteen_bit_decoder(dtype, factor, seed=seed), decoder_loss
        batches = token_batches(2 * checks, seed=seed)
    else:
        model = sixteen_bit_classifier(kind, dtype, factor, seed=seed)
        batches, loss_fn = image_batches(kind, dtype, 2 * checks, seed=seed), classifier_loss
    # eps=1e-8 underflows in float16 (its updates divide by zero and the parameters become inf): 1e-4, as pure-16-bit
    # recipes set it
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    rtol = relative_tolerance(dtype) if fixed else None
    reports: list[CheckReport] = []
    for step, batch in enumerate(batches, 1):
        optimizer.zero_grad()
        loss_fn(model, batch).backward()
        optimizer.step()
        if step % 2 == 0:
            reports.append(check_gradients(model, batch, loss_fn, step=step, rotation=step // 2, rtol=rtol))
            if stop and reports[-1].verdict == "fail":
                break
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", type=int, default=25, help="checks per healthy run, and most per buggy run")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--fixed", action="store_true", help="the fixed 16-bit tolerance instead of the measured one")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | dtype | seed | healthy checks | inconclusive | false alarms | tolerances (medians: least, median, "
          "largest) | healthy check | 5% bug: first failing check |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    totals: dict[str, collections.Counter[str]] = {}
    for kind in args.models:
        for dtype in (torch.bfloat16, torch.float16):
            name = str(dtype).removeprefix("torch.")
            for seed in range(args.seeds):
                _row(kind, dtype, name, seed, args, totals)
    for name, counts in totals.items():
        total = sum(counts.values())
        print(f"\n{name}: {counts['inconclusive']}/{total} healthy checks inconclusive "
              f"({100 * counts['inconclusive'] / total:.1f}%), {counts['fail']} false alarms")  # fmt: skip


def _tolerances(report: CheckReport) -> tuple[float, float, float]:
    """The least, median and largest per-tensor tolerance the check's note gives (its ``rtol`` thrice otherwise)."""
    note = next((n for n in report.noted("sixteen-bit-floor") if "per tensor" in n), None)
    if note is None:
        return report.rtol, report.rtol, report.rtol
    numbers = re.search(r": ([0-9.e+-]+) to ([0-9.e+-]+) \(median ([0-9.e+-]+)", note)
    assert numbers is not None, note
    return float(numbers[1]), float(numbers[3]), float(numbers[2])


def _row(kind: str, dtype: torch.dtype, name: str, seed: int, args: argparse.Namespace,
         totals: dict[str, collections.Counter[str]]) -> None:  # fmt: skip
    healthy = run(kind, dtype, 1.0, args.checks, seed, args.fixed, stop=False)
    verdicts = collections.Counter(str(r.verdict) for r in healthy)
    totals.setdefault(f"{kind} {name}", collections.Counter()).update(verdicts)
    buggy = run(kind, dtype, 1.05, args.checks, seed, args.fixed, stop=True)
    caught = len(buggy) if buggy and buggy[-1].verdict == "fail" else None
    spans = [_tolerances(r) for r in healthy]
    medians = "/".join(f"{statistics.median(span[i] for span in spans):.2g}" for i in range(3))
    print(
        f"| {kind} | {name} | {seed} | {len(healthy)} | {verdicts['inconclusive']} | {verdicts['fail']} | "
        f"{medians} | "
        f"{statistics.median(r.n_forward for r in healthy):.0f} evaluations, "
        f"{1e3 * statistics.median(r.duration_s for r in healthy):.0f} ms | "
        f"{caught if caught is not None else f'not in {args.checks}'} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
