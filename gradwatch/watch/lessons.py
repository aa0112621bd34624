"""What a run's recomputed checks teach the next ones: :class:`Lessons`.

The ``ignore`` patterns that match the model (matched once, those that match nothing warned of), the probe slice the
loss accepts (a loss that refused 2 samples is not asked again), whether it vectorises, and the focus: the tensors
the last check could not decide or saw fail, probed again at the next check so a wrong gradient found once is
confirmed at every check, not only when the rotation comes round to it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings

from torch import nn

from gradwatch.engine import CheckReport
from gradwatch.engine.function.memory import backed_off
from gradwatch.engine.results.notes import NoteCode
from gradwatch.engine.selection import unmatched_patterns
from gradwatch.engine.settings import ProbeSettings
from gradwatch.watch.alerts import GradientCheckWarning


class Lessons:
    """The settings the next check runs with (:attr:`active`) and its :attr:`focus`, learnt from the reports.

    Args:
        settings: The settings the run was given.
    """

    def __init__(self, settings: ProbeSettings) -> None:
        self.settings = settings
        self.active = settings
        self.focus: tuple[str, ...] = ()
        self._set_up_for: int | None = None  # id of the model the ignore patterns were matched to
        self._warned_no_params = False

    def checkable(self, model: nn.Module) -> bool:
        """Whether the model has a trainable floating parameter to check; warns once when it has none."""
        if any(p.requires_grad and p.is_floating_point() for p in model.parameters()):
            return True
        if not self._warned_no_params:
            self._warned_no_params = True
            warnings.warn(
                f"gradwatch: {type(model).__name__} has no trainable floating-point parameter (layers kept in a plain "
                "list or dict are not registered); its checks are skipped",
                GradientCheckWarning,
                stacklevel=5,
            )
        return False

    def set_up(self, model: nn.Module, *, force: bool = True) -> None:
        """Match the ``ignore`` patterns to the model's parameter names (once per model unless ``force``): each
        pattern that matches none warns, with the names meant; the checks then get only the patterns that match."""
        if not force and self._set_up_for == id(model):
            return
        self._set_up_for = id(model)
        names = [name for name, _ in model.named_parameters()]
        for message in unmatched_patterns(self.settings.ignore, names):
            warnings.warn(f"gradwatch: {message}", GradientCheckWarning, stacklevel=4)
        matched = tuple(p for p in self.settings.ignore if any(fnmatch.fnmatchcase(name, p) for name in names))
        self.active = dataclasses.replace(self.active, ignore=matched)

    def learn(self, report: CheckReport) -> None:
        """What a recomputed check's report teaches the next check."""
        samples = self.active.probe_batch_size
        if samples is not None and report.samples is not None and report.samples > samples:
            # the loss refused the smaller slice: no need to try it again
            self.active = dataclasses.replace(self.active, probe_batch_size=report.samples)
        retried = report.failed_tensors[: self.active.tensor_probes]  # a wrong gradient is confirmed at every check
        self.focus = tuple(dict.fromkeys([*report.undecided, *retried]))
        if any(note.code == NoteCode.OUT_OF_MEMORY for note in report.notes):
            # one step cheaper each time: native probes, native reductions, no vectorised passes, half the probe batch
            active = self.active
            cheaper = backed_off(
                report.precision, float64_reductions=active.float64_reductions, vectorize=active.vectorize,
                probe_batch_size=active.probe_batch_size, samples=report.samples,
            )  # fmt: skip
            self.active = dataclasses.replace(active, **cheaper)
        if report.vectorized is False:
            # the loss could not be vectorised: the next checks need not try again
            self.active = dataclasses.replace(self.active, vectorize=False)
