"""Reading gradwatch's results back from TensorBoard event files, one record at a time.

:func:`read_logdir` finds every run (a directory holding ``events.out.tfevents.*`` files) under a log directory, reads
each event file to its end (:mod:`.tfrecord`: every record's framing and checksums, memory bounded whatever the file's
size) and recovers from each run:

* one :class:`CheckRecord` per check, from the ``gradwatch/*`` scalars (keyed by the step they were logged at; a
  Hugging Face Trainer's run holds them as ``train/gradwatch/*``, read as the same tags);
* one :class:`FailureRecord` per failing probe, from the ``gradwatch/failures`` text, the table that
  :func:`gradwatch.engine.results.rendering.render_markdown` writes (its columns are found by their header, so a table
  with
  more columns still reads), and the culprit line above it.

Problems with the input raise :class:`EventFilesError` with the path and the reason in one line: no such directory, no
event files, no gradwatch data, an unreadable directory or file, something that is not a regular file, a file name
that is not UTF-8, a damaged or truncated record, a record that is not an event, a verdict that is not 0, 1 or 2, a
failures text that is not UTF-8 or has an unreadable row. Nothing is skipped in silence.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from tensorboard.compat.proto.event_pb2 import Event  # type: ignore[import-untyped]
from tensorboard.compat.proto.summary_pb2 import Summary  # type: ignore[import-untyped]
from tensorboard.util import tensor_util  # type: ignore[import-untyped]

from gradwatch.engine.results.rendering import CULPRIT_PREFIX
from gradwatch.engine.results.report import FAULTS, VERDICTS
from gradwatch.tensorboard.dashboard import LAYOUT_TAG
from gradwatch.tensorboard.files import EventFilesError, find_files, open_regular, shown
from gradwatch.tensorboard.tfrecord import CorruptRecordError, records
from gradwatch.tensorboard.writer import (
    APPLIED_FAILURE_TAG,
    APPLIED_PREFIX,
    CLIPPING_PREFIX,
    FAILURES_TAG,
    HISTOGRAM_TAG,
    TRAINER_PREFIX,
)

PREFIX = "gradwatch/"
VERDICT_TAG = "gradwatch/verdict"
APPLIED_VERDICT_TAG = APPLIED_PREFIX + "verdict"
APPLIED_FAULT_TAG = APPLIED_PREFIX + "fault"
CLIPPING_VERDICT_TAG = CLIPPING_PREFIX + "verdict"
CLIPPING_FAULT_TAG = CLIPPING_PREFIX + "fault"
TEXT_SUFFIX = "/text_summary"  # SummaryWriter.add_text stores text under the tag plus this suffix

__all__ = [
    "AppliedRecord",
    "CheckRecord",
    "EventFilesError",
    "FailureRecord",
    "RunEvents",
    "event_files",
    "parse_culprit",
    "parse_failures_table",
    "read_logdir",
    "read_run",
    "verify_event_file",
]


@dataclass(frozen=True)
class CheckRecord:
    """One check as logged: its step and its ``gradwatch/*`` scalars (NaN ones are not logged, so may be absent)."""

    step: int
    scalars: dict[str, float]

    @property
    def verdict(self) -> str:
        """``"ok"``, ``"inconclusive"`` or ``"fail"``, from the ``gradwatch/verdict`` scalar."""
        code = round(self.scalars[VERDICT_TAG])
        return VERDICTS[code] if 0 <= code < len(VERDICTS) else f"unknown ({code})"

    def get(self, name: str) -> float:
        """The scalar ``gradwatch/<name>``, NaN when it was not logged for this check."""
        return self.scalars.get(PREFIX + name, math.nan)


@dataclass(frozen=True)
class AppliedRecord:
    """One check of the applied gradient as logged: its step, verdict, fault (``None`` unless it failed), the fault in
    words (``""`` when not recorded) and its ``gradwatch/applied/*`` scalars."""

    step: int
    verdict: str
    fault: str | None
    fault_message: str
    scalars: dict[str, float]
    check: str = "gradient"
    """``"gradient"``: the check of the applied gradient; ``"clipping"``: the clip coefficient's, of the same step."""
    prefix: str = ""
    """The prefix of its scalars when it is not an applied check's: ``gradwatch/update/`` for an update check's."""

    def get(self, name: str) -> float:
        """The scalar ``gradwatch/applied/<name>`` (``gradwatch/applied/clipping/<name>`` for the clip coefficient's
        check, ``<prefix><name>`` for an update check's), NaN when it was not logged for this check."""
        prefix = self.prefix or (CLIPPING_PREFIX if self.check == "clipping" else APPLIED_PREFIX)
        return self.scalars.get(prefix + name, math.nan)


def fault_of_code(code: float, where: str, step: int) -> str | None:
    """The fault a ``gradwatch/applied/fault`` scalar stands for: 0 none, else its position in ``FAULTS`` plus one."""
    if not (math.isfinite(code) and code in range(len(FAULTS) + 1)):
        raise EventFilesError(f"{where}: the {APPLIED_FAULT_TAG} scalar at step {step} is {code!r}")
    return FAULTS[int(code) - 1] if code else None


_HEADLINE = re.compile(r"^\w+ fault: applied gradient check failed at step \d+: (.*)$")


def parse_fault_message(text: str) -> str:
    """The fault in words from the text of a failing applied check (its headline, as
    :func:`gradwatch.engine.results.rendering.headline` writes it), ``""`` when it has none."""
    for line in text.splitlines():
        match = _HEADLINE.match(line.strip())
        if match:
            return match.group(1)
    return ""


@dataclass(frozen=True)
class FailureRecord:
    """One failing probe, as listed in the ``gradwatch/failures`` text at ``step``."""

    step: int
    kind: str
    tensor: str
    index: str
    analytic: float
    numeric: float
    rel_error: float

    @property
    def location(self) -> str:
        """``tensor[index]``, or the tensor alone for the descent probe (``*``)."""
        return f"{self.tensor}[{self.index}]" if self.index else self.tensor


@dataclass(frozen=True)
class RunEvents:
    """What one run's event files hold about gradwatch."""

    name: str
    """The run's path relative to the log directory (``"."`` for the log directory itself)."""
    path: Path
    checks: list[CheckRecord]
    failures: list[FailureRecord] = field(default_factory=list)
    culprits: dict[int, str] = field(default_factory=dict)
    """By step, the culprit line of the failures text: the module whose backward is wrong, in words."""
    has_histogram: bool = False
    has_dashboard: bool = False
    applied: list[AppliedRecord] = field(default_factory=list)
    updates: list[AppliedRecord] = field(default_factory=list)
    """The update checks (``"scope": "update"`` in the JSON lines record), by step."""
    """The checks of the applied gradient (``gradwatch/applied/*``), by step."""
    numerics: dict[int, str] = field(default_factory=dict)
    """By step, the numerics settings a recomputed check ran under, in words (from ``gradwatch.jsonl`` only)."""

    @property
    def failed(self) -> bool:
        """Whether a failure was recorded: a failing check, a failure table or a failing applied check."""
        failing = any(c.verdict == "fail" for c in self.checks) or any(a.verdict == "fail" for a in self.applied)
        return bool(self.failures) or failing


def is_event_file(name: str) -> bool:
    """Whether a file name is a TensorBoard event file's (``events.out.tfevents.*``, as TensorBoard tells them)."""
    return "tfevents" in name


def event_files(logdir: Path) -> list[Path]:
    """Every TensorBoard event file under ``logdir``, sorted (see :func:`~gradwatch.tensorboard.files.find_files` for
    what raises)."""
    return find_files(Path(logdir), is_event_file)


def _events(path: Path) -> Iterator[Event]:
    """The events of one file, in order, read one record at a time."""
    try:
        with open_regular(path) as file:
            size = os.fstat(file.fileno()).st_size
            for data in records(file, size):
                if data is None:
                    continue  # a record too long to be gradwatch's, checked and skipped
                try:
                    yield Event.FromString(data)
                except DecodeError as error:
                    raise CorruptRecordError(f"a record that is not a TensorBoard event ({error})") from error
    except CorruptRecordError as error:
        raise EventFilesError(f"corrupt event file {shown(path)}: {error}") from error
    except OSError as error:
        raise EventFilesError(f"{shown(path)}: cannot read the file ({error.strerror or error})") from error


def verify_event_file(path: Path) -> None:
    """Raise :class:`EventFilesError` unless every record of ``path`` is whole and intact, to its last byte.

    TensorBoard itself stops silently at the first damaged record, which would turn a corrupt file into a report that
    quietly misses everything after the damage.
    """
    for _ in _events(path):
        pass


def _split_row(line: str) -> list[str]:
    # a cell may hold an escaped pipe (render_markdown writes `a\|b`)
    return [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def parse_failures_table(text: str, step: int) -> list[FailureRecord]:
    """The failing probes listed in a ``gradwatch/failures`` markdown table (other lines are ignored)."""
    found: list[FailureRecord] = []
    header: list[str] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = _split_row(line)
        if header is None:
            header = cells
            continue
        if all(set(cell) <= set("-:") for cell in cells):
            continue  # the separator row
        row = dict(zip(header, cells, strict=False))  # a short row leaves columns out: KeyError below
        try:
            found.append(
                FailureRecord(
                    step=step,
                    kind=row["kind"],
                    tensor=row["tensor"].strip("`"),
                    index=row["index"],
                    analytic=float(row["analytic"]),
                    numeric=float(row["numeric"]),
                    rel_error=float(row.get("rel. error", "nan")),
                )
            )
        except (KeyError, ValueError) as error:
            raise EventFilesError(f"unreadable row in the {FAILURES_TAG} text at step {step}: {line!r}") from error
    return found


def parse_culprit(text: str) -> str | None:
    """The culprit named in a ``gradwatch/failures`` text, or ``None``."""
    for line in text.splitlines():
        if line.startswith(CULPRIT_PREFIX):
            return line.removeprefix(CULPRIT_PREFIX).strip()
    return None


def check_verdict(value: float, step: int, where: str) -> float:
    """``value`` if it is a verdict's code (0, 1 or 2); else :class:`EventFilesError` naming ``where`` and ``step``."""
    if not (math.isfinite(value) and value in range(len(VERDICTS))):
        raise EventFilesError(
            f"{where}: the {VERDICT_TAG} scalar at step {step} is {value!r} (expected 0 ok, 1 inconclusive or 2 fail)"
        )
    return value


@dataclass
class _Run:
    """What the event files of one run hold about gradwatch, gathered record by record."""

    scalars: dict[int, dict[str, float]] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)
    applied_texts: dict[int, str] = field(default_factory=dict)
    has_histogram: bool = False
    has_dashboard: bool = False

    def add(self, path: Path, event: Event) -> None:
        for value in event.summary.value:
            if value.tag == LAYOUT_TAG:
                self.has_dashboard = True
            elif value.tag.startswith(PREFIX):
                self._add_value(path, event.step, value, value.tag)
            elif value.tag.startswith(TRAINER_PREFIX + PREFIX):
                self._add_value(path, event.step, value, value.tag.removeprefix(TRAINER_PREFIX))

    def _add_value(self, path: Path, step: int, value: Summary.Value, tag: str) -> None:
        field = value.WhichOneof("value")
        plugin = value.metadata.plugin_data.plugin_name
        if tag == HISTOGRAM_TAG and (field == "histo" or plugin == "histograms"):
            self.has_histogram = True
        elif tag.removesuffix(TEXT_SUFFIX) in (FAILURES_TAG, APPLIED_FAILURE_TAG) and field == "tensor":
            tag = tag.removesuffix(TEXT_SUFFIX)
            try:
                text = b"".join(value.tensor.string_val).decode("utf-8")
            except UnicodeDecodeError as error:
                raise EventFilesError(f"{shown(path)}: the {tag} text at step {step} is not UTF-8") from error
            (self.texts if tag == FAILURES_TAG else self.applied_texts)[step] = text
        elif field == "simple_value" or (field == "tensor" and plugin == "scalars"):
            number = value.simple_value if field == "simple_value" else _tensor_scalar(path, step, value)
            if tag in (VERDICT_TAG, APPLIED_VERDICT_TAG, CLIPPING_VERDICT_TAG):
                check_verdict(number, step, shown(path))
            elif tag in (APPLIED_FAULT_TAG, CLIPPING_FAULT_TAG):
                fault_of_code(number, shown(path), step)
            self.scalars.setdefault(step, {})[tag] = number


def _tensor_scalar(path: Path, step: int, value: Summary.Value) -> float:
    dims = [dim.size for dim in value.tensor.tensor_shape.dim]
    if any(size != 1 for size in dims):  # checked first: a shape of 2^40 would be allocated by make_ndarray
        raise EventFilesError(f"{shown(path)}: the scalar {value.tag!r} at step {step} has the shape {dims}")
    try:
        array = tensor_util.make_ndarray(value.tensor)
        return float(array.reshape(()))
    except (ValueError, TypeError) as error:
        raise EventFilesError(
            f"{shown(path)}: the scalar {value.tag!r} at step {step} is unreadable ({error})"
        ) from error


def read_run(path: Path, name: str, files: list[Path] | None = None) -> RunEvents | None:
    """The gradwatch data of the run whose event files (``files``, by default those directly in ``path``) are in
    ``path``; ``None`` when it has none."""
    if files is None:
        files = [file for file in event_files(path) if file.parent == path]
    run = _Run()
    for file in files:
        for event in _events(file):
            run.add(file, event)
    checks = [
        CheckRecord(step, {tag: v for tag, v in values.items() if not tag.startswith(APPLIED_PREFIX)})
        for step, values in sorted(run.scalars.items())
        if VERDICT_TAG in values
    ]
    applied_checks = [check for step, values in sorted(run.scalars.items())
                      for check in _applied(step, values, run.applied_texts.get(step, ""))]  # fmt: skip
    if not checks and not applied_checks:
        return None
    failures: list[FailureRecord] = []
    culprits: dict[int, str] = {}
    for step, text in sorted(run.texts.items()):
        try:
            failures += parse_failures_table(text, step)
        except EventFilesError as error:
            raise EventFilesError(f"{shown(path)}: {error}") from error
        culprit = parse_culprit(text)
        if culprit:
            culprits[step] = culprit
    return RunEvents(name, path, checks, failures, culprits, run.has_histogram, run.has_dashboard, applied_checks)


def _applied(step: int, values: dict[str, float], text: str) -> list[AppliedRecord]:
    """The applied checks logged at ``step``: the gradient's and the clip coefficient's, each with its own verdict
    (their scalars were checked as they were read); the failure text is the failing one's."""
    found = []
    for check, prefix in (("gradient", APPLIED_PREFIX), ("clipping", CLIPPING_PREFIX)):
        if prefix + "verdict" in values:
            scalars = {tag: v for tag, v in values.items() if tag.startswith(prefix)}
            scalars = {t: v for t, v in scalars.items() if check == "clipping" or not t.startswith(CLIPPING_PREFIX)}
            fault = FAULTS[round(scalars[prefix + "fault"]) - 1] if scalars.get(prefix + "fault") else None
            verdict = VERDICTS[round(scalars[prefix + "verdict"])]
            message = parse_fault_message(text) if verdict == "fail" else ""
            found.append(AppliedRecord(step, verdict, fault, message, scalars, check))
    return found


def check_directory(logdir: Path) -> None:
    """Raise :class:`EventFilesError` unless ``logdir`` is an existing directory."""
    if not logdir.exists():
        raise EventFilesError(f"log directory {shown(logdir)} does not exist")
    if not logdir.is_dir():
        raise EventFilesError(f"{shown(logdir)} is not a directory (pass the directory that holds the logs)")


def read_logdir(logdir: Path | str) -> list[RunEvents]:
    """The gradwatch data of every run under ``logdir`` that has some in event files, sorted by run name.

    Raises:
        EventFilesError: ``logdir`` does not exist or is not a directory, holds no event files, holds one that cannot
            be read to its end, or no run in it has gradwatch data (see the module's docstring).
    """
    logdir = Path(logdir)
    check_directory(logdir)
    files = event_files(logdir)
    if not files:
        raise EventFilesError(f"no TensorBoard event files (events.out.tfevents.*) under {shown(logdir)}")
    runs = []
    for directory in sorted({path.parent for path in files}):
        own = [path for path in files if path.parent == directory]
        run = read_run(directory, directory.relative_to(logdir).as_posix(), own)
        if run is not None:
            runs.append(run)
    if not runs:
        raise EventFilesError(
            f"no check was recorded under {shown(logdir)}: its {len(files)} event file(s) hold no '{VERDICT_TAG}' "
            f"scalar (nor '{TRAINER_PREFIX}{VERDICT_TAG}', as a Hugging Face Trainer's run holds them)"
        )
    return runs
