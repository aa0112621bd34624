"""Old import path, kept: ``gradwatch.report`` is now :mod:`gradwatch.engine.report`."""

from gradwatch.engine.notes import Note, NoteCode
from gradwatch.engine.report import (
    DESCENT_TARGET,
    VERDICTS,
    CheckReport,
    GradientCheckError,
    Probe,
    ProbeKind,
    Verdict,
)

__all__ = [
    "DESCENT_TARGET",
    "VERDICTS",
    "CheckReport",
    "GradientCheckError",
    "Note",
    "NoteCode",
    "Probe",
    "ProbeKind",
    "Verdict",
]
