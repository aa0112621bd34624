"""``gradwatch demo``: train the example models on synthetic data with gradwatch and print what it found.

Each run trains one model of :mod:`.demo_models` for a few hundred optimizer steps with a ``GradWatch``
callback and a ``TensorBoardLogger``, then prints a table of the checks. Runs are chosen with ``--bug``: ``none`` is the
healthy model, every other name plants one bug. The exit status is 0 when every run ended as it should (no failing
check for ``none``, at least one for a bug), 1 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradwatch.cli.reporting import _fmt
from gradwatch.engine.results.naming import display_name
from gradwatch.engine.results.rendering import render_text
from gradwatch.engine.results.report import CheckReport
from gradwatch.watch.alerts import GradientCheckWarning

if TYPE_CHECKING:
    import lightning.pytorch as pl

# Lightning and the demo's models are imported when a demo trains, not when the command line is built: `gradwatch
# report` shares this parser and needs neither (Lightning takes seconds to import).


def _model(name: str, **kwargs: Any) -> Callable[[], pl.LightningModule]:
    """A builder of the demo model ``name`` of :mod:`.demo_models`, imported when it is called."""

    def build() -> pl.LightningModule:
        from gradwatch.cli import demo_models

        model: pl.LightningModule = getattr(demo_models, name)(**kwargs)
        return model

    return build


@dataclass(frozen=True)
class Run:
    """One demo run: the directory name of its logs, what it plants and how to build its model."""

    run_name: str
    description: str
    make_model: Callable[[], pl.LightningModule]

    @property
    def healthy(self) -> bool:
        return self.run_name == "healthy"


RUNS: dict[str, Run] = {
    "none": Run("healthy", "healthy MLP (BatchNorm, ReLU, Dropout, GELU)", _model("HealthyClassifier")),
    "rmsnorm": Run(
        "rmsnorm",
        "custom RMSNorm autograd Function whose backward drops the d(1/rms)/dx term",
        _model("CustomNormClassifier", correct_backward=False),
    ),
    "scale": Run("scale", "a gradient hook multiplies net.4.weight's gradient by 1.01", _model("ScaledGradClassifier")),
    "detach": Run(
        "detach",
        "an L2 penalty built from detached weights: in the loss, not in its gradient",
        _model("DetachedPenaltyClassifier"),
    ),
}
"""The runs ``--bug`` chooses from, by name."""

DEFAULT_BUGS = ("none", "rmsnorm")


def train(
    run: Run, logdir: Path, steps: int, every: int | None, progress_bar: bool = True
) -> tuple[list[CheckReport], str]:
    """Seed, build the model and fit it for ``steps`` optimizer steps with GradWatch (checking every ``every`` steps,
    ``None``: at its defaults); returns the recomputed checks' reports and the run's log directory. The same arguments
    give the same run."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from gradwatch.cli.demo_models import synthetic_loader
    from gradwatch.integrations.lightning.callback import GradWatch

    pl.seed_everything(0, verbose=False)
    model = run.make_model()
    # --every checks on that schedule whatever it costs; without it, at the defaults (every 500 steps, within 1%)
    watch = GradWatch(every_n_steps=every, max_overhead=None) if every is not None else GradWatch()
    logger = TensorBoardLogger(str(logdir), name=run.run_name, default_hp_metric=False)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=[watch],
        log_every_n_steps=10,
        enable_model_summary=False,
        enable_checkpointing=False,
        enable_progress_bar=progress_bar,
    )
    # the table printed afterwards says it better than the warnings and log records of every failing check
    alerts_log = logging.getLogger("gradwatch")
    level = alerts_log.level
    alerts_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GradientCheckWarning)
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            trainer.fit(model, synthetic_loader())
    finally:
        alerts_log.setLevel(level)
    return watch.recomputed_reports, logger.log_dir


DEMO_LIMIT = 8
"""Failing probes of the first failing check the demo lists."""


def describe(name: str, reports: list[CheckReport]) -> str:
    """A table of a run's checks and, for failing ones, the worst probes."""
    lines = [
        f"\n== {name}: {len(reports)} checks ==",
        "| step | verdict | max rel. error | descent ratio | probes ok/fail/inconclusive | loss evaluations (passes) "
        "| ms |",
        "|---:|---|---:|---:|---|---:|---:|",
    ]
    for r in reports:
        scalars = r.scalars()
        lines.append(
            f"| {r.step} | {r.verdict} | {_fmt(scalars['gradwatch/rel_error_max'], '.2e')} | "
            f"{_fmt(r.descent_ratio, '.6f')} | {r.count('ok')}/{r.count('fail')}/{r.count('inconclusive')} | "
            f"{r.n_forward} ({r.n_passes}) | {r.duration_s * 1e3:.0f} |"
        )
    failing = [r for r in reports if r.verdict == "fail"]
    if failing:
        first = failing[0]
        lines.append(f"\nfirst failing check:\n{render_text(first, prefix='', limit=DEMO_LIMIT)}")
        tensors = sorted({p.target for r in failing for p in r.failures if not p.kind.traits.culprit_search})
        lines.append(f"tensors with failing probes over the run: {', '.join(tensors)}")
        culprits = sorted({display_name(r.culprits[0]) for r in failing if r.culprits})
        if culprits:
            lines.append(f"culprits named over the run: {', '.join(f'`{c}`' for c in culprits)}")
    return "\n".join(lines)


def outcome(run: Run, reports: list[CheckReport]) -> tuple[bool, str]:
    """Whether the run ended as it should, and a line saying how it ended."""
    failing = [r.step for r in reports if r.verdict == "fail"]
    if run.healthy:
        if failing:
            return False, f"FALSE ALARM: {len(failing)} of {len(reports)} checks failed, first at step {failing[0]}"
        return True, f"no false alarm ({len(reports)} checks, none failed)"
    if not failing:
        return False, f"NOT CAUGHT: none of {len(reports)} checks failed"
    first = " (the first check)" if reports[0].verdict == "fail" else ""
    failed = next(r for r in reports if r.verdict == "fail")
    culprit = f", culprit `{display_name(failed.culprits[0])}`" if failed.culprits else ""
    return True, f"caught at step {failing[0]}{first}{culprit}; {len(failing)} of {len(reports)} checks failed"


TENSORBOARD_TAB = "custom_scalars"
"""The TensorBoard tab with gradwatch's dashboard (TensorBoard itself opens on Time Series)."""


def next_steps(logdir: Path, run_names: Sequence[str], port: int = 6006) -> str:
    """What to run after the demo: the dashboard (the command, and the URL of the tab to open) and the summaries."""
    lines = [
        "\nnext steps:",
        f"  dashboard:  tensorboard --logdir {logdir}",
        f"              then open http://localhost:{port}/#{TENSORBOARD_TAB} (the CUSTOM SCALARS tab: relative error"
        " on a log scale, descent ratio, verdicts; the TEXT tab: each failure with its culprit)",
    ]
    lines += [f"  summary:    gradwatch report {logdir / name}" for name in run_names]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line options, shared by ``gradwatch demo`` and ``examples/demo.py``."""
    parser.add_argument(
        "--logdir", type=Path, default=Path("gradwatch_logs"), help="TensorBoard log directory (default: %(default)s)"
    )
    parser.add_argument(
        "--bug",
        action="append",
        choices=sorted(RUNS),
        help="the run to train, repeatable: 'none' (the healthy model) or a planted bug: "
        + "; ".join(f"'{name}': {run.description}" for name, run in RUNS.items() if not run.healthy)
        + f" (default: {' and '.join(DEFAULT_BUGS)})",
    )
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument(
        "--every", type=int, default=50, help="check every this many steps, plus step 1 (default: %(default)s)"
    )
    parser.add_argument(
        "--no-progress-bar",
        action="store_true",
        help="train without Lightning's progress bar (there is none when the output is not a terminal)",
    )


def run(args: argparse.Namespace) -> int:
    """Train the chosen runs, print their checks and verdicts; 0 when every run ended as it should, else 1."""
    names = list(dict.fromkeys(args.bug or DEFAULT_BUGS))  # in order, once each
    # a progress bar redraws itself with carriage returns: in a file or a pipe every redraw would be a line of its own
    progress_bar = not args.no_progress_bar and sys.stdout.isatty()
    verdicts = []
    for name in names:
        chosen = RUNS[name]
        print(f"\n>>> training '{chosen.run_name}': {chosen.description}", flush=True)
        reports, log_dir = train(chosen, args.logdir, args.steps, args.every, progress_bar=progress_bar)
        print(describe(chosen.run_name, reports))
        print(f"TensorBoard logs: {log_dir}")
        verdicts.append((chosen, *outcome(chosen, reports)))

    print("\nverdicts:")
    for chosen, _, line in verdicts:
        print(f"  {chosen.run_name}: {line}")
    print(next_steps(args.logdir, [chosen.run_name for chosen, _, _ in verdicts]))
    return 0 if all(as_expected for _, as_expected, _ in verdicts) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo as a stand-alone program (``examples/demo.py``); ``gradwatch demo`` goes through the CLI."""
    parser = argparse.ArgumentParser(prog="gradwatch demo", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
