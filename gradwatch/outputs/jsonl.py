"""The backend-neutral record of a check: one JSON object per line of ``gradwatch.jsonl``, written beside a run's
logs whatever the logger (:class:`gradwatch.outputs.sinks.JsonLinesSink`) and read back by ``gradwatch report``.

One line per check::

    {"format": "gradwatch-check", "version": 1, "step": 4, "verdict": "fail",
     "scalars": {"gradwatch/rel_error_max": 0.09, ...},
     "culprit": "the backward of `net.1` (`RMSNorm`) is wrong: ...", "culprits": ["net.1", "net"],
     "failures": [{"kind": "tensor", "target": "net.0.weight", "index": null, "location": "net.0.weight",
                   "analytic": 1.02, "numeric": 0.98, "rel_error": 0.04, "noise": 1e-06, "reason": "discrepancy"}],
     "surrogates": [], "notes": ["..."], "note_codes": ["whole-batch"], "loss": 0.7, "duration_s": 0.05,
     "scope": ..., "fault": ...}

A number that is not finite is written as the string ``"nan"``, ``"inf"`` or ``"-inf"`` and read back as the float.
``scope``, ``fault`` and ``numerics`` (:meth:`gradwatch.engine.results.numerics.Numerics.as_dict`) are there when the
report has them. An applied or update check also has ``fault_message`` (``null`` when none), and its scalars are the
``gradwatch/applied/*`` (``gradwatch/update/*``) ones. ``note_codes`` holds each note's code
(:class:`gradwatch.engine.results.notes.NoteCode`), for readers that act on notes without parsing their wording.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from enum import Enum
from typing import Any

from gradwatch.engine.results.notes import codes
from gradwatch.engine.results.numerics import describe_numerics
from gradwatch.engine.results.rendering import ordered_failures
from gradwatch.engine.results.report import FAULTS, VERDICTS
from gradwatch.errors import ReportInputError
from gradwatch.outputs.records import CheckRecords
from gradwatch.tensorboard.writer import (
    APPLIED_PREFIX,
    APPLIED_VERDICT_TAG,
    CLIPPING_PREFIX,
    CLIPPING_VERDICT_TAG,
    PREFIX,
    UPDATE_PREFIX,
    VERDICT_TAG,
)

JSONL_NAME = "gradwatch.jsonl"
"""The file name of the record, in the directory of the run's logs."""

FORMAT = "gradwatch-check"
VERSION = 1
OPTIONAL_FIELDS = ("scope", "fault", "numerics")
"""Attributes of a report recorded when it has them (set by other parts of gradwatch, any JSON-able shape)."""

_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@dataclass(frozen=True)
class CheckRecord:
    """One check as recorded: its step and its ``gradwatch/*`` scalars (NaN ones are not logged, so may be absent)."""

    step: int
    scalars: dict[str, float]

    @property
    def verdict(self) -> str:
        """``"ok"``, ``"inconclusive"`` or ``"fail"``, from the ``gradwatch/verdict`` scalar."""
        return VERDICTS[round(self.scalars[VERDICT_TAG])]

    def get(self, name: str) -> float:
        """The scalar ``gradwatch/<name>``, NaN when it was not logged for this check."""
        return self.scalars.get(PREFIX + name, math.nan)


@dataclass(frozen=True)
class AppliedRecord:
    """One check around the optimizer step as recorded: its step, verdict, fault (``None`` unless it failed), the fault
    in words (``""`` when not recorded) and its scalars."""

    step: int
    verdict: str
    fault: str | None
    fault_message: str
    scalars: dict[str, float]
    check: str = "gradient"
    """``"gradient"``: the check of the applied gradient; ``"clipping"``: the clip coefficient's, of the same step."""
    _: KW_ONLY
    prefix: str = ""
    """The prefix of its scalars when it is not an applied check's: ``gradwatch/update/`` for an update check's."""

    def get(self, name: str) -> float:
        """The scalar ``gradwatch/applied/<name>`` (``gradwatch/applied/clipping/<name>`` for the clip coefficient's
        check, ``<prefix><name>`` for an update check's), NaN when it was not logged for this check."""
        prefix = self.prefix or (CLIPPING_PREFIX if self.check == "clipping" else APPLIED_PREFIX)
        return self.scalars.get(prefix + name, math.nan)


@dataclass(frozen=True)
class FailureRecord:
    """One failing probe of a recorded check."""

    step: int
    kind: str
    tensor: str
    index: str
    analytic: float
    numeric: float
    _: KW_ONLY
    rel_error: float

    @property
    def location(self) -> str:
        """``tensor[index]``, or the tensor alone for the descent probe (``*``)."""
        return f"{self.tensor}[{self.index}]" if self.index else self.tensor


def number(value: float) -> float | str:
    """``value`` as JSON can hold it: the float, or ``"nan"``, ``"inf"``, ``"-inf"``."""
    value = float(value)
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON data: enums by their value, dataclasses and mappings as objects, sequences as lists,
    non-finite floats as strings (:func:`number`), anything else by its ``str``."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return number(value)
    if isinstance(value, Enum):
        return jsonable(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(item) for item in value]
    return str(value)


def _word(value: Any) -> str:
    return str(getattr(value, "value", value))  # a kind or verdict that is an Enum: its value


def record_json(records: CheckRecords) -> dict[str, Any]:
    """The JSON object of one check (see the module's docstring)."""
    report = records.report
    record: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(records.step),
        "verdict": _word(report.verdict),
        "scalars": {tag: number(value) for tag, value in records.scalars.items()},
        "culprit": report.culprit_message or None,
        "culprits": list(report.culprits),
        "failures": [
            {
                "kind": _word(probe.kind),
                "target": probe.target,
                "index": None if probe.index is None else [int(i) for i in probe.index],
                "location": probe.location,
                "analytic": number(probe.analytic),
                "numeric": number(probe.numeric),
                "rel_error": number(probe.rel_error),
                "noise": number(probe.noise),
                "reason": _word(probe.reason),
            }
            for probe in ordered_failures(report)
        ],
        "surrogates": [str(finding) for finding in report.surrogates],
        "notes": [str(note) for note in report.notes],
        "note_codes": [None if code is None else str(code) for code in codes(report.notes)],
        "loss": number(report.loss),
        "duration_s": number(report.duration_s),
    }
    for name in OPTIONAL_FIELDS:
        value = getattr(report, name, None)
        if value is not None:
            record[name] = jsonable(value)
    if getattr(report, "scope", None) in ("applied", "update"):
        record["fault_message"] = report.fault_message or None
    return record


class _BadRecordError(ValueError):
    """A field of a record that is not what the format says (caught by :func:`parse_record`)."""


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_number(value: Any, what: str) -> float:
    """A number written by :func:`number`."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    raise _BadRecordError(f"{what} is {_brief(value)}, not a number")


def _text(value: str, what: str) -> str:
    try:
        value.encode("utf-8")  # a lone surrogate (an escaped "\ud800") would fail when printed
    except UnicodeEncodeError as error:
        raise _BadRecordError(f"{what} is not valid Unicode") from error
    return value


def _field(record: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = record.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise _BadRecordError(f"'{name}' is {_brief(value)}")
    return _text(value, f"'{name}'") if isinstance(value, str) else value


def _failure(step: int, item: Any) -> FailureRecord:
    if not isinstance(item, Mapping):
        raise _BadRecordError(f"a failure is {_brief(item)}, not an object")
    index = item.get("index")
    if index is not None and not (isinstance(index, list) and all(type(i) is int for i in index)):
        raise _BadRecordError(f"a failure's index is {_brief(index)}")
    return FailureRecord(
        step=step,
        kind=_field(item, "kind", str),
        tensor=_field(item, "target", str) or "(the model)",
        index="" if index is None else ", ".join(str(i) for i in index),
        analytic=read_number(item.get("analytic"), "a failure's analytic derivative"),
        numeric=read_number(item.get("numeric"), "a failure's numeric derivative"),
        rel_error=read_number(item.get("rel_error", "nan"), "a failure's relative error"),
    )


def parse_record(record: Any) -> tuple[CheckRecord, list[FailureRecord], str | None]:
    """One decoded line: the check, its failing probes and its culprit in words (``None`` when none was named).

    Raises:
        ReportInputError: The object is not a gradwatch check record of a known version, or a field is malformed
            (a verdict that is not ``ok``, ``inconclusive`` or ``fail``, a step that is not a whole number ≥ 0, a
            verdict scalar that contradicts the verdict, ...). The caller adds the path and line.
    """
    try:
        if not isinstance(record, Mapping) or record.get("format") != FORMAT:
            raise _BadRecordError("not a gradwatch check record")
        version = record.get("version")
        if type(version) is not int or version != VERSION:
            raise _BadRecordError(f"record version {_brief(version)}, this gradwatch reads version {VERSION}")
        step = _field(record, "step", int)
        if step < 0:
            raise _BadRecordError(f"'step' is {step}")
        verdict = _field(record, "verdict", str)
        if verdict not in VERDICTS:
            raise _BadRecordError(f"'verdict' is {_brief(verdict)} (expected one of {', '.join(VERDICTS)})")
        scalars = {
            _text(tag, "a scalar's tag"): read_number(value, f"scalar {_brief(tag)}")
            for tag, value in _field(record, "scalars", dict).items()
        }
        code = float(VERDICTS.index(verdict))
        if scalars.setdefault(VERDICT_TAG, code) != code:
            raise _BadRecordError(
                f"the {VERDICT_TAG} scalar {scalars[VERDICT_TAG]!r} contradicts the verdict {verdict!r}"
            )
        failures = [_failure(step, item) for item in _field(record, "failures", list)]
        culprit = record.get("culprit")
        if culprit is not None:
            culprit = _field(record, "culprit", str)
    except _BadRecordError as error:
        raise ReportInputError(str(error)) from error
    return CheckRecord(step, scalars), failures, culprit or None


def record_numerics(record: Any) -> str | None:
    """A decoded line's numerics settings in words (:func:`~gradwatch.engine.results.numerics.describe_numerics`);
    ``None`` when it has none (a record of an older gradwatch) or they are not an object."""
    settings = record.get("numerics") if isinstance(record, Mapping) else None
    return describe_numerics(settings) if isinstance(settings, Mapping) else None


def parse_update_record(record: Any) -> AppliedRecord:
    """One decoded line of an update check (``"scope": "update"``), checked as :func:`parse_applied_record` checks an
    applied check's; its scalars are the ``gradwatch/update/*`` ones."""
    parsed = parse_applied_record(record)
    scalars = {tag: value for tag, value in record.get("scalars", {}).items() if tag.startswith(UPDATE_PREFIX)}
    numbers = {tag: read_number(value, f"scalar {tag!r}") for tag, value in scalars.items()}
    return AppliedRecord(parsed.step, parsed.verdict, parsed.fault, parsed.fault_message, numbers, prefix=UPDATE_PREFIX)


def parse_applied_record(record: Any) -> AppliedRecord:
    """One decoded line of an applied check (``"scope": "applied"``): format, version, step and verdict checked as
    :func:`parse_record` checks them, and the fault is none or one of :data:`~gradwatch.engine.results.report.FAULTS`.

    Raises:
        ReportInputError: A field is malformed. The caller adds the path and line.
    """
    check, _, _ = parse_record(record)
    try:
        fault = record.get("fault")
        if fault is not None and fault not in FAULTS:
            raise _BadRecordError(f"'fault' is {_brief(fault)} (expected null or one of {', '.join(FAULTS)})")
        message = record.get("fault_message")
        message = "" if message is None else _field(record, "fault_message", str)
        code = float(VERDICTS.index(check.verdict))
        kind = "clipping" if _is_clipping(record, check.scalars) else "gradient"
        tag = CLIPPING_VERDICT_TAG if kind == "clipping" else APPLIED_VERDICT_TAG
        if check.scalars.get(tag, code) != code:
            raise _BadRecordError(f"the {tag} scalar contradicts the verdict {check.verdict!r}")
    except _BadRecordError as error:
        raise ReportInputError(str(error)) from error
    scalars = {tag: value for tag, value in check.scalars.items() if tag.startswith(APPLIED_PREFIX)}
    return AppliedRecord(check.step, check.verdict, fault, message, scalars, kind)


def _is_clipping(record: Mapping[str, Any], scalars: Mapping[str, float]) -> bool:
    """Whether an applied line is the clip coefficient's check: its scalars under the clipping prefix, or (a record
    written before they were) its note code ``applied-clipping``."""
    codes = record.get("note_codes")
    return CLIPPING_VERDICT_TAG in scalars or (isinstance(codes, list) and "applied-clipping" in codes)
