"""Reading a log directory back for ``gradwatch report``: every ``gradwatch.jsonl`` under it (:mod:`.jsonl`; a run is a
directory holding one), and for the folder of a W&B or MLflow run, the records beside it (:mod:`.beside`). Every record
is read to its end, one line at a time with a bounded length, and anything that cannot be read raises
:class:`~gradwatch.errors.ReportInputError` with the path and the reason: nothing is skipped in silence.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

from gradwatch.errors import ReportInputError
from gradwatch.outputs import beside
from gradwatch.outputs.jsonl import (
    JSONL_NAME,
    AppliedRecord,
    CheckRecord,
    FailureRecord,
    parse_applied_record,
    parse_record,
    parse_update_record,
    record_numerics,
)
from gradwatch.outputs.logdir import check_directory, find_files, open_regular, shown

MAX_LINE_BYTES = 16 << 20
"""The longest line of a JSON lines record read (a check with thousands of failing probes is a few hundred KB)."""

__all__ = ["MAX_LINE_BYTES", "JsonLines", "RunRecord", "read_jsonl", "read_logdir"]


@dataclass(frozen=True)
class RunRecord:
    """What one run's ``gradwatch.jsonl`` holds, each kind of check in order of its step."""

    name: str
    """The run's path relative to the log directory (``"."`` for the log directory itself), or the W&B or MLflow run
    whose record sits beside it."""
    path: Path
    checks: list[CheckRecord]
    failures: list[FailureRecord] = field(default_factory=list)
    culprits: dict[int, str] = field(default_factory=dict)
    """By step, the module whose backward is wrong, in words."""
    applied: list[AppliedRecord] = field(default_factory=list)
    """The checks of the applied gradient and the clip coefficient's checks, by step (the gradient's first)."""
    _: KW_ONLY
    updates: list[AppliedRecord] = field(default_factory=list)
    """The update checks (``"scope": "update"``), by step."""
    numerics: dict[int, str] = field(default_factory=dict)
    """By step, the numerics settings a recomputed check ran under, in words."""

    @property
    def failed(self) -> bool:
        """Whether a failure was recorded: a failing check of any kind, or a failing probe."""
        verdicts = [c.verdict for c in self.checks] + [r.verdict for r in (*self.applied, *self.updates)]
        return bool(self.failures) or "fail" in verdicts


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
    _: KW_ONLY
    updates: dict[int, AppliedRecord] = field(default_factory=dict)
    """The update checks (``"scope": "update"``), by step."""


def read_jsonl(path: Path) -> JsonLines:
    """The checks recorded in one JSON lines file.

    Raises:
        ReportInputError: The file cannot be opened or read, is not a regular file, has a line longer than
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
                    raise ReportInputError(f"{where}: line {number} is longer than {MAX_LINE_BYTES} bytes")
                if not line.endswith(b"\n"):
                    raise ReportInputError(f"{where}: line {number} is cut short (no newline): a truncated record")
                if not line.strip():
                    continue
                try:
                    decoded = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError as error:
                    raise ReportInputError(f"{where}: line {number} is not UTF-8") from error
                except ValueError as error:  # json.JSONDecodeError, or a number too long to convert
                    raise ReportInputError(f"{where}: line {number} is not JSON ({error})") from error
                except RecursionError as error:
                    raise ReportInputError(f"{where}: line {number} is nested too deeply to read") from error
                scope = decoded.get("scope") if isinstance(decoded, Mapping) else None
                try:
                    if scope == "update":
                        update = parse_update_record(decoded)
                        found.updates[update.step] = update
                        continue
                    if scope == "applied":
                        applied = parse_applied_record(decoded)
                        (found.clipping if applied.check == "clipping" else found.applied)[applied.step] = applied
                        continue
                    check, failures, culprit = parse_record(decoded)
                except ReportInputError as error:
                    raise ReportInputError(f"{where}: line {number}: {error}") from error
                numerics = record_numerics(decoded)
                if numerics is not None:
                    found.numerics[check.step] = numerics
                found.checks[check.step] = check
                found.failures[check.step] = failures
                found.culprits.pop(check.step, None)
                if culprit:
                    found.culprits[check.step] = culprit
    except OSError as error:
        raise ReportInputError(f"{where}: cannot read the file ({error.strerror or error})") from error
    return found


def _run(name: str, directory: Path, lines: JsonLines) -> RunRecord | None:
    """One run from its JSON lines record; ``None`` when it holds no check."""
    if not (lines.checks or lines.applied or lines.clipping or lines.updates):
        return None
    # every applied record of a step listed with its own verdict: the gradient's, then the clip coefficient's
    applied = [(step, 0, record) for step, record in lines.applied.items()]
    applied += [(step, 1, record) for step, record in lines.clipping.items()]
    return RunRecord(
        name=name,
        path=directory,
        checks=[lines.checks[step] for step in sorted(lines.checks)],
        failures=[f for step in sorted(lines.failures) for f in lines.failures[step]],
        culprits=dict(sorted(lines.culprits.items())),
        applied=[record for _, _, record in sorted(applied, key=lambda item: item[:2])],
        updates=[lines.updates[step] for step in sorted(lines.updates)],
        numerics=dict(sorted(lines.numerics.items())),
    )


def read_logdir(logdir: Path | str) -> list[RunRecord]:
    """The gradwatch data of every run under ``logdir`` (each directory holding a ``gradwatch.jsonl``), sorted by
    name; for the folder of a Weights & Biases or MLflow run (or a folder of them), the records beside it
    (:mod:`gradwatch.outputs.beside`).

    Raises:
        ReportInputError: ``logdir`` is missing or not a directory, holds one record that cannot be read to its end
            (see :func:`read_jsonl`), or no gradwatch data can be found: the message says what was found instead
            (TensorBoard event files without a record, a record without a check, a W&B run whose record is in none
            of the folders searched, ...).
    """
    logdir = Path(logdir)
    check_directory(logdir)
    records = sorted(find_files(logdir, lambda name: name == JSONL_NAME), key=lambda path: path.parent)
    runs = [
        run
        for record in records
        if (run := _run(record.parent.relative_to(logdir).as_posix(), record.parent, read_jsonl(record))) is not None
    ]
    if runs:
        return runs
    tool_runs = beside.tool_runs(logdir)
    for tool_run in tool_runs:
        for record in beside.records_beside(tool_run):
            run = _run(f"{tool_run.tool} run {tool_run.run_id}", record.parent, read_jsonl(record))
            if run is not None:
                runs.append(run)
    if runs:
        return runs
    raise ReportInputError(_nothing_found(logdir, records, tool_runs))


def _nothing_found(logdir: Path, records: list[Path], tool_runs: list[beside.ToolRun]) -> str:
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
    if records:
        return f"no check was recorded under {where}: its {len(records)} {JSONL_NAME} file(s) hold no check"
    events = len(find_files(logdir, lambda name: "tfevents" in name))
    found = f" (it holds {events} TensorBoard event file(s), which gradwatch report does not read)" if events else ""
    return f"no gradwatch records under {where}: no {JSONL_NAME}, nor a Weights & Biases or MLflow run folder{found}"
