"""Reading a log directory back for ``gradwatch report``: TensorBoard event files and the JSON lines record
(:mod:`.jsonl`), so the command works whatever logger the run used (CSV, Weights & Biases, MLflow, TensorBoard).

A run is a directory holding event files, a ``gradwatch.jsonl`` or both (a TensorBoard run gets both). Where both
record a check, the JSON lines record wins (it keeps every failure at full precision, with the culprit); a check only
one of them holds is taken from it. Every file is read to its end, one record (line) at a time with a bounded length,
and anything that cannot be read raises :class:`EventFilesError` with the path and the reason: nothing is skipped in
silence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from gradwatch.outputs import beside
from gradwatch.outputs.jsonl import (
    JSONL_NAME,
    is_applied,
    is_update,
    parse_applied_record,
    parse_record,
    parse_update_record,
    record_numerics,
)
from gradwatch.tensorboard.events import (
    APPLIED_VERDICT_TAG,
    VERDICT_TAG,
    AppliedRecord,
    CheckRecord,
    EventFilesError,
    FailureRecord,
    RunEvents,
    check_directory,
    is_event_file,
    read_run,
)
from gradwatch.tensorboard.files import find_files, open_regular, shown
from gradwatch.tensorboard.writer import TRAINER_PREFIX

MAX_LINE_BYTES = 16 << 20
"""The longest line of a JSON lines record read (a check with thousands of failing probes is a few hundred KB)."""

__all__ = ["MAX_LINE_BYTES", "EventFilesError", "JsonLines", "read_jsonl", "read_logdir"]


@dataclass
class JsonLines:
    """The checks of one ``gradwatch.jsonl``, by step (a step logged twice, after a resume: the last line)."""

    checks: dict[int, CheckRecord] = field(default_factory=dict)
    failures: dict[int, list[FailureRecord]] = field(default_factory=dict)
    culprits: dict[int, str] = field(default_factory=dict)
    applied: dict[int, AppliedRecord] = field(default_factory=dict)
    """The applied checks of the gradient (``"scope": "applied"``), by step."""
    clipping: dict[int, AppliedRecord] = field(default_factory=dict)
    """The clip coefficient's checks, by step (the step of the applied check it follows, listed beside it)."""
    numerics: dict[int, str] = field(default_factory=dict)
    """The numerics settings of the recomputed checks, in words, by step."""
    updates: dict[int, AppliedRecord] = field(default_factory=dict)
    """The update checks (``"scope": "update"``), by step."""


def read_jsonl(path: Path) -> JsonLines:
    """The checks recorded in one JSON lines file.

    Raises:
        EventFilesError: The file cannot be opened or read, is not a regular file, has a line longer than
            :data:`MAX_LINE_BYTES`, a line that is not UTF-8 or not JSON, a last line without its newline (a record
            cut short), or a record that is not a gradwatch check (:func:`gradwatch.outputs.jsonl.parse_record`).
    """
    found = JsonLines()
    where = shown(path)
    try:
        with open_regular(path) as file:
            number = 0
            while line := file.readline(MAX_LINE_BYTES + 1):
                number += 1
                if len(line) > MAX_LINE_BYTES:
                    raise EventFilesError(f"{where}: line {number} is longer than {MAX_LINE_BYTES} bytes")
                if not line.endswith(b"\n"):
                    raise EventFilesError(f"{where}: line {number} is cut short (no newline): a truncated record")
                if not line.strip():
                    continue
                try:
                    decoded = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError as error:
                    raise EventFilesError(f"{where}: line {number} is not UTF-8") from error
                except ValueError as error:  # json.JSONDecodeError, or a number too long to convert
                    raise EventFilesError(f"{where}: line {number} is not JSON ({error})") from error
                except RecursionError as error:
                    raise EventFilesError(f"{where}: line {number} is nested too deeply to read") from error
                try:
                    if is_update(decoded):
                        update = parse_update_record(decoded)
                        found.updates[update.step] = update
                        continue
                    if is_applied(decoded):
                        applied = parse_applied_record(decoded)
                        (found.clipping if applied.check == "clipping" else found.applied)[applied.step] = applied
                        continue
                    check, failures, culprit = parse_record(decoded)
                except EventFilesError as error:
                    raise EventFilesError(f"{where}: line {number}: {error}") from error
                numerics = record_numerics(decoded)
                if numerics is not None:
                    found.numerics[check.step] = numerics
                found.checks[check.step] = check
                found.failures[check.step] = failures
                found.culprits.pop(check.step, None)
                if culprit:
                    found.culprits[check.step] = culprit
    except OSError as error:
        raise EventFilesError(f"{where}: cannot read the file ({error.strerror or error})") from error
    return found


def _wanted(name: str) -> bool:
    return name == JSONL_NAME or is_event_file(name)


def _merge(name: str, directory: Path, events: RunEvents | None, lines: JsonLines | None) -> RunEvents | None:
    """One run from its event files and its JSON lines record; the record wins for a step both hold."""
    if lines is None or not (lines.checks or lines.applied or lines.clipping or lines.updates):
        return events
    # every applied record of a step listed with its own verdict: the gradient's, then the clip coefficient's
    applied = {(step, "gradient"): record for step, record in lines.applied.items()}
    applied.update({(step, "clipping"): record for step, record in lines.clipping.items()})
    checks = dict(lines.checks)
    failures = [f for step in sorted(lines.failures) for f in lines.failures[step]]
    culprits = dict(lines.culprits)
    if events is not None:
        for check in events.checks:
            checks.setdefault(check.step, check)
        failures += [f for f in events.failures if f.step not in lines.checks]
        culprits.update({step: text for step, text in events.culprits.items() if step not in lines.checks})
        for logged in events.applied:
            applied.setdefault((logged.step, logged.check), logged)
    return RunEvents(
        name=name,
        path=directory,
        checks=[checks[step] for step in sorted(checks)],
        failures=sorted(failures, key=lambda f: f.step),  # stable: the order within a check is kept
        culprits=dict(sorted(culprits.items())),
        has_histogram=events is not None and events.has_histogram,
        has_dashboard=events is not None and events.has_dashboard,
        applied=[applied[key] for key in sorted(applied, key=lambda key: (key[0], key[1] == "clipping"))],
        numerics=dict(sorted(lines.numerics.items())),
        updates=[lines.updates[step] for step in sorted(lines.updates)],
    )


def read_logdir(logdir: Path | str) -> list[RunEvents]:
    """The gradwatch data of every run under ``logdir``, from event files and JSON lines records, sorted by name; for
    the folder of a Weights & Biases or MLflow run (or a folder of them), the records beside it
    (:mod:`gradwatch.outputs.beside`).

    Raises:
        EventFilesError: ``logdir`` is missing or not a directory, holds one file that cannot be read to its end (see
            :func:`read_jsonl` and :mod:`gradwatch.tensorboard.events`), or no gradwatch data can be found: the
            message says what was found instead (event files without a gradwatch scalar, a W&B run whose record is
            in none of the folders searched, ...).
    """
    logdir = Path(logdir)
    check_directory(logdir)
    files = find_files(logdir, _wanted)
    runs = _runs(logdir, files)
    if runs:
        return runs
    tool_runs = beside.tool_runs(logdir)
    for tool_run in tool_runs:
        for record in beside.records_beside(tool_run):
            run = _merge(f"{tool_run.tool} run {tool_run.run_id}", record.parent, None, read_jsonl(record))
            if run is not None:
                runs.append(run)
    if runs:
        return runs
    raise EventFilesError(_nothing_found(logdir, files, tool_runs))


def _runs(logdir: Path, files: list[Path]) -> list[RunEvents]:
    """The runs of ``files`` (event files and records under ``logdir``) that have gradwatch data."""
    runs = []
    for directory in sorted({path.parent for path in files}):
        own = [path for path in files if path.parent == directory]
        name = directory.relative_to(logdir).as_posix()
        events = [path for path in own if is_event_file(path.name)]
        from_events = read_run(directory, name, events) if events else None
        jsonl = directory / JSONL_NAME
        run = _merge(name, directory, from_events, read_jsonl(jsonl) if jsonl in own else None)
        if run is not None:
            runs.append(run)
    return runs


def _nothing_found(logdir: Path, files: list[Path], tool_runs: list[beside.ToolRun]) -> str:
    """Why ``gradwatch report`` found nothing under ``logdir``, in words: what it found instead."""
    where = shown(logdir)
    if tool_runs:
        runs = ", ".join(f"{run.tool} run {run.run_id}" for run in tool_runs[:3])
        more = f" and {len(tool_runs) - 3} more" if len(tool_runs) > 3 else ""
        above = list(tool_runs[0].path.parents)[: beside.ANCESTORS]
        return (
            f"{where} holds {runs}{more}, whose records sit beside it, in "
            f"{beside.RECORDS_DIR}/<logger>-...-<run id>/{JSONL_NAME} under the training's root folder (Lightning's "
            f"default_root_dir, a Hugging Face Trainer's output_dir), and none is there (searched {shown(above[0])} "
            f"up to {shown(above[-1])} and their sub-folders): pass the folder that holds it"
        )
    events = sum(is_event_file(path.name) for path in files)
    records = len(files) - events
    if not files:
        return (
            f"no gradwatch records under {where}: neither a {JSONL_NAME} nor TensorBoard event files "
            "(events.out.tfevents.*), nor a Weights & Biases or MLflow run folder"
        )
    held = []
    if events:
        held.append(
            f"{events} TensorBoard event file(s) without a '{VERDICT_TAG}' or '{APPLIED_VERDICT_TAG}' scalar (nor "
            f"'{TRAINER_PREFIX}{VERDICT_TAG}', as a Hugging Face Trainer's run holds them)"
        )
    if records:
        held.append(f"{records} {JSONL_NAME} file(s) without a check")
    return f"no check was recorded under {where}: it holds {' and '.join(held)}; no check of its run(s) was logged"
