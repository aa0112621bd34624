"""The ``gradwatch`` command: its parser (``gradwatch demo``: :mod:`.demo`; ``gradwatch report``: :mod:`.reporting`)
and its entry point."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gradwatch import __version__
from gradwatch.cli import demo, reporting
from gradwatch.cli.output import silence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradwatch",
        description="Check that the gradients a model trains on are the derivatives of its loss.",
        epilog="Exit status of 'report': 0 no failure recorded, 1 a failure recorded, 2 unreadable input, 3 a run "
        "whose every check was inconclusive.",
    )
    parser.add_argument("--version", action="version", version=f"gradwatch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,report}")

    demo_parser = commands.add_parser(
        "demo",
        help="train the example models with gradwatch and print what it found",
        description="Train the example models on synthetic data with gradwatch, print the verdicts and the "
        "tensorboard command to look at them. Exit status 0 when every run ended as expected (the healthy model "
        "without a failing check, each planted bug caught), 1 otherwise.",
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(handler=demo.run)

    report_parser = commands.add_parser(
        "report",
        help="summarise the gradwatch results recorded under a log directory",
        description="Summarise the gradwatch results under LOGDIR (the gradwatch.jsonl every logger's run gets, and "
        "TensorBoard event files): the culprits, the checks, verdicts over time, the worst tensors and every failure. "
        "Exit status 0 when no failure was recorded, 1 when one was, 2 when the input cannot be fully read (each "
        "problem on one line: path and reason), 3 when every check of a run was inconclusive.",
    )
    reporting.add_arguments(report_parser)
    report_parser.set_defaults(handler=reporting.report)
    return parser


EXIT_OUTPUT_CLOSED = 1
"""The exit status of a command whose output's reader went away before it ended (``gradwatch demo | head``);
``gradwatch report`` keeps its own verdict, decided before it prints."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradwatch`` console script and of ``python -m gradwatch``.

    A reader that goes away (``gradwatch report DIR | head``) ends the output quietly, without a BrokenPipeError
    traceback (see :mod:`.output`)."""
    try:
        args = build_parser().parse_args(argv)
        return int(args.handler(args))
    except BrokenPipeError:
        silence(sys.stdout)
        silence(sys.stderr)
        return EXIT_OUTPUT_CLOSED


if __name__ == "__main__":
    sys.exit(main())
