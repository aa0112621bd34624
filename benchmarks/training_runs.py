"""False alarms inside real training runs: the example models trained with GradWatch over several seeds.

    python benchmarks/training_runs.py [--seeds 20] [--steps 300] [--every 10]

Trains ``HealthyClassifier`` (BatchNorm, ReLU, Dropout) and ``CustomNormClassifier`` with its *correct* custom
backward, checking every ``--every`` optimizer steps, so the checks see the whole trajectory from initialisation to
late training, where gradients are small. Every gradient is correct: every failing check is a false alarm. Prints a
markdown table of check verdicts and the reasons probes gave.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from models import CustomNormClassifier, HealthyClassifier, synthetic_loader

from gradwatch import GradWatch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    warnings.simplefilter("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    models = {
        "HealthyClassifier": HealthyClassifier,
        "CustomNormClassifier (correct backward)": lambda: CustomNormClassifier(correct_backward=True),
    }
    print("| model | runs | checks | ok | inconclusive | failing (false alarms) | probe reasons | s |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for name, make in models.items():
        verdicts: collections.Counter[str] = collections.Counter()
        reasons: collections.Counter[str] = collections.Counter()
        started = time.perf_counter()
        for seed in range(args.seeds):
            pl.seed_everything(seed, verbose=False)
            watch = GradWatch(every_n_steps=args.every, seed=seed)
            trainer = pl.Trainer(
                max_steps=args.steps,
                accelerator="cpu",
                logger=False,
                callbacks=[watch],
                enable_progress_bar=False,
                enable_model_summary=False,
                enable_checkpointing=False,
            )
            trainer.fit(make(), synthetic_loader(seed=seed))
            verdicts.update(r.verdict for r in watch.reports)
            reasons.update(p.reason for r in watch.reports for p in r.probes)
        mix = ", ".join(f"{reason} {count}" for reason, count in reasons.most_common())
        print(
            f"| {name} | {args.seeds} | {sum(verdicts.values())} | {verdicts['ok']} | {verdicts['inconclusive']} | "
            f"{verdicts['fail']} | {mix} | {time.perf_counter() - started:.0f} |"
        )


if __name__ == "__main__":
    main()
