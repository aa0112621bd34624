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

from gradwatch.outputs.jsonl import JSONL_NAME, parse_record
from gradwatch.tensorboard.events import (
    VERDICT_TAG,
    CheckRecord,
    EventFilesError,
    FailureRecord,
    RunEvents,
    check_directory,
    is_event_file,
    read_run,
)
from gradwatch.tensorboard.files import find_files, open_regular, shown

MAX_LINE_BYTES = 16 << 20
"""The longest line of a JSON lines record read (a check with thousands of failing probes is a few hundred KB)."""

__all__ = ["MAX_LINE_BYTES", "EventFilesError", "JsonLines", "read_jsonl", "read_logdir"]


@dataclass
class JsonLines:
    """The checks of one ``gradwatch.jsonl``, by step (a step logged twice, after a resume: the last line)."""

    checks: dict[int, CheckRecord] = field(default_factory=dict)
    failures: dict[int, list[FailureRecord]] = field(default_factory=dict)
    culprits: dict[int, str] = field(default_factory=dict)


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
                    check, failures, culprit = parse_record(decoded)
                except EventFilesError as error:
                    raise EventFilesError(f"{where}: line {number}: {error}") from error
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
    if lines is None or not lines.checks:
        return events
    checks = dict(lines.checks)
    failures = [f for step in sorted(lines.failures) for f in lines.failures[step]]
    culprits = dict(lines.culprits)
    if events is not None:
        for check in events.checks:
            checks.setdefault(check.step, check)
        failures += [f for f in events.failures if f.step not in lines.checks]
        culprits.update({step: text for step, text in events.culprits.items() if step not in lines.checks})
    return RunEvents(
        name=name,
        path=directory,
        checks=[checks[step] for step in sorted(checks)],
        failures=sorted(failures, key=lambda f: f.step),  # stable: the order within a check is kept
        culprits=dict(sorted(culprits.items())),
        has_histogram=events is not None and events.has_histogram,
        has_dashboard=events is not None and events.has_dashboard,
    )


def read_logdir(logdir: Path | str) -> list[RunEvents]:
    """The gradwatch data of every run under ``logdir``, from event files and JSON lines records, sorted by name.

    Raises:
        EventFilesError: ``logdir`` is missing or not a directory, holds neither event files nor a
            ``gradwatch.jsonl``, holds one that cannot be read to its end (see :func:`read_jsonl` and
            :mod:`gradwatch.tensorboard.events`), or no run in it has gradwatch data.
    """
    logdir = Path(logdir)
    check_directory(logdir)
    files = find_files(logdir, _wanted)
    if not files:
        raise EventFilesError(
            f"no gradwatch records under {shown(logdir)}: neither a {JSONL_NAME} nor TensorBoard event files "
            "(events.out.tfevents.*)"
        )
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
    if not runs:
        raise EventFilesError(
            f"the {len(files)} file(s) under {shown(logdir)} hold no gradwatch data (no check in a {JSONL_NAME}, no "
            f"'{VERDICT_TAG}' scalar in an event file): was GradWatch among the Trainer's callbacks, and did a check "
            "run?"
        )
    return runs
