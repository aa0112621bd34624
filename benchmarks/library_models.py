"""Verdicts and cost per check on models of the kinds third-party libraries train (``tests/library_models.py``).

Each model trains with SGD on synthetic batches, with a check after every 5 training steps (on the first 2 samples of
the batch, as ``GradWatch`` checks). The table gives the verdicts, the loss evaluations and wall time per check
(median), and the cost of a check in training steps (check time over the median time of one training step of the same
run). "model left changed" counts checks after which a parameter or buffer slot of the model held another tensor or
dtype than before; "training crashed" counts training steps that raised after a check. Planted bugs: the check at
which the bug was first caught.

Run: ``python benchmarks/library_models.py [--steps N]`` (a few minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from library_models import BUGGY, CORRECT, LibraryCase

from gradwatch import CheckReport, check_gradients

PROBE_BATCH_SIZE = 2
"""As ``GradWatch`` probes: the loss of the first 2 samples (or graphs) of the batch."""


STEPS_PER_CHECK = 5
"""Training steps between checks; their median time is the unit of a check's cost (tiny models' timings jitter)."""


def _slots(model: torch.nn.Module) -> dict[tuple[int, str, str], tuple[int, torch.dtype]]:
    found = {}
    for module in model.modules():
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for name, tensor in table.items():
                if tensor is not None:
                    found[(id(module), kind, name)] = (id(tensor), tensor.dtype)
    return found


def run(case: LibraryCase, steps: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = case.build()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batches = case.batches()
    reports: list[CheckReport] = []
    step_times: list[float] = []
    changed = crashed = 0
    raised: list[str] = []
    for step in range(steps):
        batch = batches[step % len(batches)]
        try:
            for _ in range(STEPS_PER_CHECK):  # the training steps between checks, timed one by one
                started = time.perf_counter()
                optimizer.zero_grad()
                case.loss_fn(model, batch).backward()
                optimizer.step()
                step_times.append(time.perf_counter() - started)
        except Exception:
            crashed += 1
            break
        before = _slots(model)
        try:
            reports.append(check_gradients(model, batch, case.loss_fn, step=step, probe_batch_size=PROBE_BATCH_SIZE))
        except Exception as error:
            raised.append(f"{type(error).__name__}: {str(error)[:60]}")
        changed += _slots(model) != before
    return {"reports": reports, "step_s": statistics.median(step_times) if step_times else float("nan"),
            "changed": changed, "crashed": crashed, "raised": raised}  # fmt: skip


def _why(reports: list[CheckReport], raised: list[str]) -> str:
    if raised:
        return f"check raised {len(raised)}x: {raised[0]}"
    if all(not r.probes for r in reports):
        first = next((n for r in reports for n in r.notes), "")
        return f"no probe: {first[:70]}"
    reasons = collections.Counter(p.reason for r in reports if r.verdict != "ok" for p in r.probes if p.verdict != "ok")
    return ", ".join(f"{reason} ({count})" for reason, count in reasons.most_common()) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="checks per model")
    args = parser.parse_args()
    for name in ("lightning", "lightning.fabric", "transformers", "gradwatch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)

    print(f"## Correct models ({args.steps} checks, one every {STEPS_PER_CHECK} training steps)\n")
    print("| model | ok | inconclusive | fail | why not ok | precision | evaluations per check | ms per check | "
          "training steps per check | model left changed | training crashed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for case in CORRECT:
        result = run(case, args.steps)
        reports: list[CheckReport] = result["reports"]  # type: ignore[assignment]
        counts = collections.Counter(r.verdict for r in reports)
        evaluations = statistics.mean(r.n_forward for r in reports) if reports else float("nan")
        seconds = statistics.median(r.duration_s for r in reports) if reports else float("nan")
        precision = "/".join(sorted({r.precision for r in reports})) or "-"
        why = _why(reports, result["raised"])  # type: ignore[arg-type]
        print(f"| {case.name} | {counts['ok']} | {counts['inconclusive']} | {counts['fail']} | {why} | "
              f"{precision} | {evaluations:.0f} | {1e3 * seconds:.0f} | {seconds / result['step_s']:.0f} | "  # type: ignore[operator]
              f"{result['changed']} | {result['crashed']} |")  # fmt: skip
        sys.stdout.flush()

    print(f"\n## Planted bugs ({args.steps} checks, one every {STEPS_PER_CHECK} training steps)\n")
    print("| model | caught at check | failing targets | evaluations per check |")
    print("|---|---|---|---|")
    for case in BUGGY:
        result = run(case, args.steps)
        reports = result["reports"]  # type: ignore[assignment]
        first = next((i for i, r in enumerate(reports, 1) if r.verdict == "fail"), None)
        targets = sorted({p.target for r in reports for p in r.failures if p.kind in ("tensor", "param", "descent")})
        evaluations = statistics.mean(r.n_forward for r in reports) if reports else float("nan")
        print(f"| {case.name} | {first or 'never'} | {', '.join(targets) or '-'} | {evaluations:.0f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
