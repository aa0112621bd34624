"""Train the example models with gradwatch on synthetic data, then print what it found and where the logs are.

    python examples/demo.py [--logdir gradwatch_logs] [--steps 300] [--every 50]

Two runs: a healthy classifier (BatchNorm, Dropout), where every check should pass, and a classifier whose custom
autograd Function has a subtly wrong backward, which gradwatch should flag at its first check (step 1). Exits with 0
when both outcomes are as expected.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import CustomNormClassifier, HealthyClassifier, synthetic_loader

from gradwatch import CheckReport, GradientCheckWarning, GradWatch


def train(
    make_model: Callable[[], pl.LightningModule], logdir: Path, name: str, steps: int, every: int
) -> tuple[GradWatch, str]:
    """Seed, build the model and fit it for ``steps`` optimizer steps with GradWatch; returns the callback and the
    log directory. The same arguments give the same run."""
    pl.seed_everything(0, verbose=False)
    model = make_model()
    watch = GradWatch(every_n_steps=every)
    logger = TensorBoardLogger(str(logdir), name=name, default_hp_metric=False)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=[watch],
        log_every_n_steps=10,
        enable_model_summary=False,
        enable_checkpointing=False,
        enable_progress_bar=sys.stdout.isatty(),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradientCheckWarning)  # the table below says it better
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(model, synthetic_loader())
    return watch, logger.log_dir


def _fmt(value: float, spec: str) -> str:
    return "n/a" if math.isnan(value) else format(value, spec)


def describe(name: str, reports: list[CheckReport]) -> str:
    """A table of the run's checks and, for failing ones, the worst probes."""
    lines = [
        f"\n== {name}: {len(reports)} checks ==",
        "| step | verdict | max rel. error | descent ratio | probes ok/fail/inconclusive | forwards | ms |",
        "|---:|---|---:|---:|---|---:|---:|",
    ]
    for r in reports:
        scalars = r.scalars()
        lines.append(
            f"| {r.step} | {r.verdict} | {_fmt(scalars['gradwatch/rel_error_max'], '.2e')} | "
            f"{_fmt(r.descent_ratio, '.6f')} | {r.count('ok')}/{r.count('fail')}/{r.count('inconclusive')} | "
            f"{r.n_forward} | {r.duration_s * 1e3:.0f} |"
        )
    failing = [r for r in reports if r.verdict == "fail"]
    if failing:
        first = failing[0]
        lines.append(f"\nfirst failing check (step {first.step}):")
        lines += [f"  {probe.describe()}" for probe in first.failures]
        tensors = sorted({p.target for r in failing for p in r.failures})
        lines.append(f"tensors with failing probes over the run: {', '.join(tensors)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", type=Path, default=Path("gradwatch_logs"), help="TensorBoard log directory")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--every", type=int, default=50, help="check every this many steps (plus step 1)")
    args = parser.parse_args(argv)

    runs: dict[str, Callable[[], pl.LightningModule]] = {
        "healthy": HealthyClassifier,
        "custom_function_bug": lambda: CustomNormClassifier(correct_backward=False),
    }
    outcomes = {}
    for name, make_model in runs.items():
        watch, log_dir = train(make_model, args.logdir, name, args.steps, args.every)
        print(describe(name, watch.reports))
        print(f"TensorBoard logs: {log_dir}")
        outcomes[name] = [r.verdict for r in watch.reports]

    healthy_clean = "fail" not in outcomes["healthy"]
    bug_caught = bool(outcomes["custom_function_bug"]) and outcomes["custom_function_bug"][0] == "fail"
    print(f"\nhealthy model: {'no false alarm' if healthy_clean else 'FALSE ALARM'}")
    print(f"custom Function with a wrong backward: {'caught at the first check' if bug_caught else 'NOT CAUGHT'}")
    print(f"look at it: tensorboard --logdir {args.logdir}")
    return 0 if healthy_clean and bug_caught else 1


if __name__ == "__main__":
    sys.exit(main())
