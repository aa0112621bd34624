"""Checks of the gradient the optimizer applies, on the path training computes it (autocast, compiled code,
accumulation, cross-rank reduction, hooks), against central differences of the accumulation window's loss; a failure
names the part of the path at fault (``report.fault``). See ``docs/applied.md``."""

from gradwatch.engine.applied.check import check_applied_gradient
from gradwatch.engine.applied.window import AppliedWindow, Checksums, Combine, PathContext

__all__ = ["AppliedWindow", "Checksums", "Combine", "PathContext", "check_applied_gradient"]
