"""Old import path, kept: ``gradwatch.lightning.alerts`` is now :mod:`gradwatch.watch.alerts`."""

from gradwatch.watch.alerts import (
    BLIND_AFTER,
    ON_FAIL_CHOICES,
    AlertPolicy,
    Backoff,
    GradientCheckWarning,
    OnFail,
    Remarks,
    failure_message,
)

__all__ = [
    "BLIND_AFTER",
    "ON_FAIL_CHOICES",
    "AlertPolicy",
    "Backoff",
    "GradientCheckWarning",
    "OnFail",
    "Remarks",
    "failure_message",
]
