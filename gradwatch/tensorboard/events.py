"""Reading gradwatch's results back from TensorBoard event files, with TensorBoard's own reader.

:func:`read_logdir` finds every run (a directory holding ``events.out.tfevents.*`` files) under a log directory, checks
that TensorBoard can read each event file to its end, and recovers from each run:

* one :class:`CheckRecord` per check, from the ``gradwatch/*`` scalars (keyed by the step they were logged at);
* one :class:`FailureRecord` per failing probe, from the ``gradwatch/failures`` text, the table that
  :func:`gradwatch.tensorboard.writer.failures_markdown` writes (its columns are found by their header, so a table with
  more columns still reads).

Problems with the input (no such directory, no event files, no gradwatch data, an event file TensorBoard cannot read to
its end) raise :class:`EventFilesError` with a message meant for the user.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from tensorboard.backend.event_processing import io_wrapper
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader

from gradwatch.engine.report import VERDICTS
from gradwatch.tensorboard.dashboard import LAYOUT_TAG
from gradwatch.tensorboard.writer import CULPRIT_PREFIX, FAILURES_TAG, HISTOGRAM_TAG

PREFIX = "gradwatch/"
VERDICT_TAG = "gradwatch/verdict"
TEXT_SUFFIX = "/text_summary"
"""``SummaryWriter.add_text`` stores text under the tag plus this suffix."""

# Every record of a TFRecord file is framed by a length (8 bytes) and two CRC-32C checksums (4 bytes each)
_RECORD_FRAMING = 16


class EventFilesError(Exception):
    """The log directory or its event files cannot give a report (missing, empty, corrupt, without gradwatch data)."""


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

    @property
    def failed(self) -> bool:
        """Whether a failure was recorded: a failing check or a failure table."""
        return bool(self.failures) or any(check.verdict == "fail" for check in self.checks)


def event_files(logdir: Path) -> list[Path]:
    """Every TensorBoard event file under ``logdir``, sorted."""
    return sorted(p for p in logdir.rglob("*tfevents*") if p.is_file() and io_wrapper.IsSummaryEventsFile(str(p)))


def verify_event_file(path: Path) -> None:
    """Raise :class:`EventFilesError` unless TensorBoard's record reader reads ``path`` to its last byte.

    TensorBoard itself stops silently at the first damaged record, which would turn a corrupt file into a report that
    quietly misses everything after the damage.
    """
    size = path.stat().st_size
    read = sum(len(record) + _RECORD_FRAMING for record in RawEventFileLoader(str(path)).Load())
    if read != size:
        raise EventFilesError(
            f"corrupt event file {path}: TensorBoard could read only {read} of its {size} bytes "
            "(a damaged or truncated record)"
        )


def parse_failures_table(text: str, step: int) -> list[FailureRecord]:
    """The failing probes listed in a ``gradwatch/failures`` markdown table (other lines are ignored)."""
    records: list[FailureRecord] = []
    header: list[str] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if all(set(cell) <= set("-:") for cell in cells):
            continue  # the separator row
        row = dict(zip(header, cells, strict=False))  # a short row leaves columns out: KeyError below
        try:
            records.append(
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
    return records


def parse_culprit(text: str) -> str | None:
    """The culprit named in a ``gradwatch/failures`` text, or ``None``."""
    for line in text.splitlines():
        if line.startswith(CULPRIT_PREFIX):
            return line.removeprefix(CULPRIT_PREFIX).strip()
    return None


def _text(event: object) -> str:
    proto = event.tensor_proto  # type: ignore[attr-defined]
    return b"".join(proto.string_val).decode("utf-8", errors="replace")


def read_run(path: Path, name: str) -> RunEvents | None:
    """The gradwatch data of the run whose event files are in ``path``; ``None`` when it has none."""
    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    scalar_tags = [tag for tag in tags["scalars"] if tag.startswith(PREFIX)]
    if VERDICT_TAG not in scalar_tags:
        return None
    by_step: dict[int, dict[str, float]] = {}
    for event in accumulator.Scalars(VERDICT_TAG):
        by_step[event.step] = {}
    for tag in scalar_tags:
        for event in accumulator.Scalars(tag):
            if event.step in by_step:
                by_step[event.step][tag] = event.value
    failures_tag = FAILURES_TAG + TEXT_SUFFIX
    failures = []
    culprits = {}
    if failures_tag in tags["tensors"]:
        for event in accumulator.Tensors(failures_tag):
            text = _text(event)
            failures += parse_failures_table(text, event.step)
            culprit = parse_culprit(text)
            if culprit:
                culprits[event.step] = culprit
    return RunEvents(
        name=name,
        path=path,
        checks=[CheckRecord(step, scalars) for step, scalars in sorted(by_step.items())],
        failures=failures,
        culprits=culprits,
        has_histogram=HISTOGRAM_TAG in tags["histograms"],
        has_dashboard=LAYOUT_TAG in tags["tensors"],
    )


def read_logdir(logdir: Path | str) -> list[RunEvents]:
    """The gradwatch data of every run under ``logdir`` that has some, sorted by run name.

    Raises:
        EventFilesError: ``logdir`` does not exist or is not a directory, holds no event files, holds a corrupt event
            file, or no run in it has gradwatch data.
    """
    logdir = Path(logdir)
    if not logdir.exists():
        raise EventFilesError(f"log directory {logdir} does not exist")
    if not logdir.is_dir():
        raise EventFilesError(f"{logdir} is not a directory (pass the directory that holds the event files)")
    files = event_files(logdir)
    if not files:
        raise EventFilesError(f"no TensorBoard event files (events.out.tfevents.*) under {logdir}")
    for path in files:
        verify_event_file(path)
    runs = []
    for directory in sorted({path.parent for path in files}):
        run = read_run(directory, directory.relative_to(logdir).as_posix())
        if run is not None:
            runs.append(run)
    if not runs:
        raise EventFilesError(
            f"the {len(files)} event file(s) under {logdir} hold no gradwatch data (no '{VERDICT_TAG}' scalar): "
            "was GradWatch among the Trainer's callbacks, with a TensorBoardLogger, and did a check run?"
        )
    return runs
