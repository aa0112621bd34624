"""A planted attention bug in a diffusers ``UNet2DModel``: checks until the first failure, and the culprit named then.

The UNet (``tests/unet_models.py``: three resolutions, attention in the two lower ones and the mid block, random init)
trains on DDPM batches (noisy images, timesteps, the noise-prediction MSE) with AdamW under
``GradientWatch(every_n_steps=2, max_overhead=None)``: a recomputed check every 2 optimizer steps at the watch's
defaults. One attention's backward is 2% wrong: a projection's weight or input gradient (``to_q``, ``to_k``, ``to_v``,
``to_out.0``), or the softmax of its processor (the query's and key's gradients). The culprit is judged against the
module holding the bug: **right** (that module; for a projection, one inside it), **container** (a module containing it)
or **wrong** (any other, including a projection of the attention whose processor holds the bug). A correct model's
checks show the healthy cost and that none fails. ``--above-limit`` makes the model count as above the float64 limit
(``AUTO_FLOAT64_ELEMENTS``): native probes, undecided ones measured again in float64, as for a UNet of 35M parameters.

Run: ``python benchmarks/unet_detection.py`` (mid-size: channels 32, 32, 64 at 16×16, a few minutes on 2 CPU cores);
``--channels 64,128,256 --resolution 32`` for the 11M-parameter UNet (minutes per failing check on CPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from unet_models import BUGS, ddpm_batches, noise_prediction_loss, unet
from watched_runs import first_check_with

from gradwatch import CheckReport
from gradwatch.engine.function import precision


def judged(culprits: list[str], holder: str, inside_allowed: bool) -> str:
    """The named culprit against the module holding the bug (see the module doc)."""
    if not culprits:
        return "none"
    named = culprits[0]
    if named == holder or (inside_allowed and named.startswith(f"{holder}.")):
        return "right"
    if named == "" or holder.startswith(f"{named}."):
        return "container"
    return "wrong"


def run(
    bug: str | None, checks: int, channels: tuple[int, ...], resolution: int
) -> tuple[int | None, CheckReport | None, list[int]]:
    """Train under the watch until the first check that is not ``ok`` or ``checks`` checks: its position, its report,
    and the loss evaluations of every ``ok`` check."""
    batches = ddpm_batches(2 * checks + 2, resolution=resolution)
    return first_check_with(unet(bug, channels=channels), batches, noise_prediction_loss, lr=1e-4, checks=checks,
                            stop=("fail", "inconclusive"))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", type=int, default=5, help="the most checks per run")
    parser.add_argument("--channels", default="32,32,64", help="block_out_channels")
    parser.add_argument("--resolution", type=int, default=16, help="image side")
    parser.add_argument("--above-limit", action="store_true", help="probe as a model above the float64 limit")
    parser.add_argument("--bugs", default=",".join(BUGS), help="which of tests/unet_models.BUGS")
    args = parser.parse_args()
    channels = tuple(int(c) for c in args.channels.split(","))
    if args.above_limit:
        precision.AUTO_FLOAT64_ELEMENTS = 0
    size = sum(p.numel() for p in unet(None, channels=channels).parameters())
    where = "above the float64 limit" if args.above_limit else "float64 probes"
    print(f"## UNet2DModel {channels} at {args.resolution}², {size / 1e6:.2f}M parameters, {where}\n")
    print("| bug | module holding it | checks until the first failure | culprit named | judged | evaluations | s |")
    print("|---|---|---|---|---|---|---|")
    for bug in args.bugs.split(","):
        holder, where_bug = BUGS[bug]
        started = time.perf_counter()
        first, report, _ = run(bug, args.checks, channels, args.resolution)
        seconds = time.perf_counter() - started
        if report is None:
            print(f"| {bug} | `{holder}` | not within {args.checks} | - | - | - | {seconds:.0f} |")
            continue
        named = f"`{report.culprits[0]}`" if report.culprits else "-"
        verdict = judged(report.culprits, holder, where_bug != "softmax")
        shown = first if report.verdict == "fail" else f"{first} ({report.verdict})"
        print(f"| {bug} | `{holder}` | {shown} | {named} | {verdict} | {report.n_forward} | {seconds:.0f} |")
    started = time.perf_counter()
    first, report, healthy = run(None, args.checks, channels, args.resolution)
    seconds = time.perf_counter() - started
    outcome = "none failed or was inconclusive" if first is None else f"check {first} {report.verdict}"  # type: ignore[union-attr]
    print(
        f"\ncorrect model: {len(healthy)} ok checks, {outcome}, "
        f"{statistics.mean(healthy) if healthy else float('nan'):.1f} loss evaluations per check, "
        f"{seconds:.0f} s with training"
    )


if __name__ == "__main__":
    main()
