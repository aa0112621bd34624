"""``gradwatch report LOGDIR [--plot FILE.png]``: summarise the gradwatch records under ``LOGDIR``: the JSON lines
record every logger's run gets (``gradwatch.jsonl``, :mod:`gradwatch.outputs.reading`).

Exit status: 0 when no failure was recorded, 1 when one was (so it can gate a CI job), 2 when the input cannot be fully
read (a missing, empty or unreadable directory or file, something not a regular file, a name not UTF-8, a corrupt or
truncated record, an unknown verdict, no gradwatch data) or the command line is wrong, 3 when a run's every check was
inconclusive (a gate that passed would have checked nothing). Applied and update checks (``"scope"`` in the record)
count as checks: a failing one exits 1, and each run lists them in sections of their own, failures led by the fault.
Input problems are printed one per line, path and reason, never as a traceback; nothing is skipped in silence, so exit
0 means every record was read.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradwatch.cli.output import emit
from gradwatch.engine.results.rendering import searches
from gradwatch.errors import MissingExtraError, ReportInputError
from gradwatch.outputs.jsonl import AppliedRecord, FailureRecord
from gradwatch.outputs.logdir import shown
from gradwatch.outputs.reading import RunRecord, read_logdir

EXIT_OK = 0
EXIT_FAILURE_RECORDED = 1
EXIT_BAD_INPUT = 2
EXIT_NOTHING_CHECKED = 3
"""A run whose every check was inconclusive: nothing failed, and nothing was checked either."""


def _fmt(value: float, spec: str = ".3g") -> str:
    return "n/a" if math.isnan(value) else format(value, spec)


def _table(header: Sequence[str], rows: Sequence[Sequence[str] | str], align: str) -> list[str]:
    """A plain-text table, columns padded; ``align`` holds one ``<`` or ``>`` per column. A row given as a string is
    printed as it is (a remark such as "... 12 more")."""
    cells = [row for row in rows if not isinstance(row, str)]
    widths = [max(len(cell) for cell in column) for column in zip(header, *cells, strict=True)]

    def line(row: Sequence[str] | str) -> str:
        if isinstance(row, str):
            return row
        return "  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(row, align, widths, strict=True)).rstrip()

    return [line(header), line(["-" * w for w in widths])] + [line(row) for row in rows]


def _elide(rows: list[list[str]], max_rows: int, what: str) -> list[list[str] | str]:
    """At most ``max_rows`` rows (0: all): the first and last ones, with a line saying how many were left out."""
    if max_rows <= 0 or len(rows) <= max_rows:
        return list(rows)
    head, tail = (max_rows + 1) // 2, max_rows // 2
    marker = f"... {len(rows) - head - tail} more {what} (--max-rows 0 shows all)"
    return [*rows[:head], marker, *rows[len(rows) - tail :]]


def _first(rows: list[Any], max_rows: int, what: str) -> list[Any]:
    """The first ``max_rows`` rows (0: all) of a ranking, then a line saying how many more there are."""
    if max_rows <= 0 or len(rows) <= max_rows:
        return list(rows)
    return [*rows[:max_rows], f"... and {len(rows) - max_rows} more {what} (--max-rows 0 shows all)"]


def _numerics_lines(run: RunRecord) -> list[str]:
    """The numerics settings the checks ran under, each set once with the steps it held (in a run that changed them,
    as a fit that turns TF32 on after a warm-up does, each change)."""
    spans: list[list[Any]] = []  # [settings, first step, last step, checks]
    for step, settings in run.numerics.items():
        if spans and spans[-1][0] == settings:
            spans[-1][2:] = [step, spans[-1][3] + 1]
        else:
            spans.append([settings, step, step, 1])
    lines = [f"numerics (steps {first} to {last}, {n} checks): {settings}" for settings, first, last, n in spans]
    return [*lines, ""] if lines else []


def _culprit_lines(run: RunRecord, max_rows: int) -> list[str]:
    """One line per check that named a culprit, the first ``max_rows`` (0: all), then how many were left out."""
    lines = _first([f"culprit at step {step}: {message}" for step, message in run.culprits.items()], max_rows,
                   "culprit lines")  # fmt: skip
    return [*lines, ""] if lines else []


def _worst_tensors(failures: Sequence[FailureRecord]) -> list[list[str]]:
    """The tensors with failing probes, most failing probes first. The probes of a culprit search are left out: their
    target is a module (``""`` the model itself), which the culprit line names better than a count."""
    by_tensor: dict[str, list[float]] = {}
    steps_by_tensor: dict[str, set[int]] = {}
    for f in failures:
        if searches(f.kind):
            continue
        by_tensor.setdefault(f.tensor, []).append(f.rel_error)
        steps_by_tensor.setdefault(f.tensor, set()).add(f.step)

    worst = {t: max((e for e in errors if not math.isnan(e)), default=math.nan) for t, errors in by_tensor.items()}
    order = sorted(by_tensor, key=lambda t: (-len(by_tensor[t]), -worst[t] if not math.isnan(worst[t]) else 0.0, t))
    return [[t, str(len(by_tensor[t])), str(len(steps_by_tensor[t])), _fmt(worst[t])] for t in order]


def _applied_lines(run: RunRecord, max_rows: int) -> list[str]:
    """The applied checks of a run: of the gradient the optimizer applied, and the clip coefficient's of the step."""
    rows = [
        [
            str(a.step),
            "clip coefficient" if a.check == "clipping" else "gradient",
            a.verdict,
            a.fault or "-",
            _fmt(a.get("floor_excess"), ".3g"),
            _fmt(a.get("noise_floor"), ".2e"),
            _fmt(a.get("descent_ratio"), ".6f"),
        ]
        for a in run.applied
    ]
    header = ["step", "check", "verdict", "fault", "floor excess", "noise floor", "descent ratio"]
    return _checks_of_the_step(run.applied, "applied", "the gradient the optimizer applied", header, rows, max_rows)


def _update_lines(run: RunRecord, max_rows: int) -> list[str]:
    """The update checks of a run: the update the optimizer made, against a reference."""
    rows = [
        [str(u.step), u.verdict, u.fault or "-", _fmt(u.get("floor_excess"), ".3g"),
         _fmt(u.get("rel_error_max"), ".2e"), _fmt(u.get("noise_floor"), ".2e")]
        for u in run.updates
    ]  # fmt: skip
    header = ["step", "verdict", "fault", "floor excess", "max rel. error", "floor"]
    return _checks_of_the_step(run.updates, "update", "the update the optimizer made", header, rows, max_rows)


def _checks_of_the_step(
    records: Sequence[AppliedRecord], kind: str, what: str, header: list[str], rows: list[list[str]], max_rows: int
) -> list[str]:
    """The lines of one kind of check around the optimizer step: the counts, each failing one led by its fault and
    what named it, then the table (``rows`` under ``header``, the text columns left-aligned)."""
    if not records:
        return []
    counts = {verdict: sum(r.verdict == verdict for r in records) for verdict in ("ok", "inconclusive", "fail")}
    lines = [f"{kind} checks ({what}): {len(records)}, " + ", ".join(f"{n} {v}" for v, n in counts.items())]
    failing = [
        f"{r.fault or 'unknown'} fault at step {r.step}: {r.fault_message or '(no message recorded)'}"
        for r in records
        if r.verdict == "fail"
    ]
    lines += _first(failing, max_rows, f"failing {kind} checks")
    align = ">" + "".join("<" if column in ("check", "verdict", "fault") else ">" for column in header[1:])
    return [*lines, *_table(header, _elide(rows, max_rows, f"{kind} checks"), align)]


def _first_fault(run: RunRecord) -> str:
    """``"; precision fault in the applied gradient at step 4"`` for the first failing applied check, else ``""``."""
    failing = [a for a in run.applied if a.verdict == "fail"]
    if not failing:
        return ""
    return f"; {failing[0].fault or 'unknown'} fault in the applied gradient at step {failing[0].step}"


def format_run(run: RunRecord, max_rows: int = 20) -> str:
    """The report of one run: verdict counts, the applied checks (failures led by their fault), the culprits, the
    checks over time, the worst tensors and every failure."""
    checks = run.checks
    counts = {verdict: sum(c.verdict == verdict for c in checks) for verdict in ("ok", "inconclusive", "fail")}
    failing_steps = [c.step for c in checks if c.verdict == "fail"]
    applied = _applied_lines(run, max_rows)
    updates = _update_lines(run, max_rows)
    applied = [*applied, *([""] if applied and updates else []), *updates]
    if not checks:
        update = f", {len(run.updates)} update" if run.updates else ""
        title = f"== run {run.name}: no recomputed check, {len(run.applied)} applied{update}{_first_fault(run)} =="
        return "\n".join([title, "", *applied])
    lines = [
        f"== run {run.name}: {len(checks)} checks, steps {checks[0].step} to {checks[-1].step}: "
        + ", ".join(f"{n} {verdict}" for verdict, n in counts.items())
        + (f"; first failure at step {failing_steps[0]}" if failing_steps else "")
        + _first_fault(run)
        + " ==",
        "",
        *([*applied, ""] if applied else []),
        *_numerics_lines(run),
        *_culprit_lines(run, max_rows),
        "checks (verdicts over time):",
    ]
    rows = [
        [
            str(c.step),
            c.verdict,
            _fmt(c.get("rel_error_median"), ".2e"),
            _fmt(c.get("rel_error_max"), ".2e"),
            _fmt(c.get("descent_ratio"), ".6f"),
            _fmt(c.get("failing_probes"), ".0f"),
            _fmt(c.get("inconclusive_probes"), ".0f"),
        ]
        for c in checks
    ]
    header = ["step", "verdict", "median rel. err", "max rel. err", "descent ratio", "failing", "inconclusive"]
    lines += _table(header, _elide(rows, max_rows, "checks"), "><>>>>>")

    if run.failures:
        tensors = _worst_tensors(run.failures)
        if tensors:
            lines += ["", "worst tensors (by failing probes; '*' is the descent probe along the whole gradient):"]
            lines += _table(
                ["tensor", "failing probes", "in checks", "worst rel. err"],
                _first(tensors, max_rows, "tensors"),
                "<>>>",
            )
        lines += ["", "failures:"]
        rows = [
            [str(f.step), f.kind, f.tensor, f.index or "-", f"{f.analytic:.6g}", f"{f.numeric:.6g}", _fmt(f.rel_error)]
            for f in run.failures
        ]
        header = ["step", "kind", "tensor", "index", "analytic", "numeric", "rel. err"]
        lines += _table(header, _elide(rows, max_rows, "failures"), "><<<>>>")
    elif failing_steps:
        lines += ["", "failing checks were recorded, but not their failing probes"]
    return "\n".join(lines)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise MissingExtraError(
            "--plot needs matplotlib, which is not installed; install the 'plot' extra: pip install 'gradwatch[plot]' "
            "(or pip install matplotlib)"
        ) from error
    return plt


def plot(runs: Sequence[RunRecord], path: Path) -> None:
    """A figure of relative error over steps for each run (median, band min to max, failing checks marked).

    Raises:
        MissingExtraError: matplotlib is not installed.
    """
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for run in runs:
        checks = run.checks
        if not checks:
            continue  # applied checks only: no relative errors to draw
        steps = [c.step for c in checks]
        median = [c.get("rel_error_median") for c in checks]
        (line,) = axes.plot(steps, median, marker="o", markersize=3, label=f"{run.name}: median")
        axes.fill_between(
            steps, [c.get("rel_error_min") for c in checks], [c.get("rel_error_max") for c in checks],
            color=line.get_color(), alpha=0.2, linewidth=0,
        )  # fmt: skip
        failing = [(c.step, c.get("rel_error_max")) for c in checks if c.verdict == "fail"]
        if failing:
            axes.scatter(*zip(*failing, strict=True), marker="x", color="red", zorder=3)
    axes.scatter([], [], marker="x", color="red", label="failing check (its max rel. error)")
    axes.set_yscale("log")
    axes.set_xlabel("step")
    axes.set_ylabel("relative error (conclusive probes)")
    axes.set_title("gradwatch: relative error of the checks (band: min to max)")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def verdict(runs: Sequence[RunRecord]) -> tuple[int, str]:
    """The exit status and the result line of a report over ``runs``."""
    failed = [run.name for run in runs if run.failed]
    if failed:
        names = ", ".join(failed)
        return EXIT_FAILURE_RECORDED, f"result: FAIL, gradient failures recorded in {names} (exit status 1)"
    blind = [
        run.name
        for run in runs
        if not any(check.verdict in ("ok", "fail") for check in run.checks)
        and not any(check.verdict in ("ok", "fail") for check in run.applied)
    ]
    if blind:
        names = ", ".join(blind)
        return EXIT_NOTHING_CHECKED, f"result: NOTHING CHECKED, every check of {names} was inconclusive (exit status 3)"
    return EXIT_OK, "result: ok, no gradient failure recorded (exit status 0)"


def _error(message: str) -> int:
    emit(f"gradwatch report: error: {message}", sys.stderr)
    return EXIT_BAD_INPUT


def report(args: argparse.Namespace) -> int:
    """``gradwatch report``: print the summary of every run under the log directory; exit status as documented.

    The exit status is decided before anything is printed, so a reader that stops early (``| head``) changes nothing."""
    try:
        if args.plot is not None:
            _pyplot()  # before reading anything, so a missing extra costs no wait
        runs = read_logdir(args.logdir)
    except (ReportInputError, MissingExtraError) as error:
        return _error(str(error))
    code, result = verdict(runs)
    blocks = [f"gradwatch report: {shown(args.logdir)} ({len(runs)} run{'s' if len(runs) != 1 else ''})\n"]
    blocks += [format_run(run, args.max_rows) + "\n" for run in runs]
    if not all(emit(block) for block in blocks):
        return code  # the reader went away; the verdict stands
    if args.plot is not None:
        try:
            plot(runs, args.plot)
        except OSError as error:
            return _error(f"cannot write the plot {shown(args.plot)} ({error.strerror or error})")
        emit(f"plot written to {shown(args.plot)}")
    emit(result)
    return code


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``gradwatch report``."""
    parser.add_argument("logdir", type=Path, metavar="LOGDIR", help="a log directory (searched recursively)")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="also write a figure (needs matplotlib)")
    parser.add_argument("--max-rows", type=int, default=20, help="rows per table, 0 for all (default: %(default)s)")
