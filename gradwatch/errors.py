"""Every exception and warning gradwatch defines, in one module, lowest in the layers so that any module may raise them.

In order: those for users (:class:`GradientCheckError`, :class:`GradientCheckWarning`, :class:`UnrestoredStateWarning`,
:class:`NoLossToCheckError`: raised by a ``loss_fn`` that has no loss for a batch), the reasons a check ends
(:class:`CheckAbandonedError` and its kinds), the signals between gradwatch's own modules (their old modules import them
from here, so old import paths still work), the command line's, and :func:`own_error`, which tells an error of
gradwatch's own from one of the code it runs (the user's loss, model or optimizer).
"""

from __future__ import annotations

import os
import sysconfig
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gradwatch.engine.results.report import CheckReport

ERROR_LIMIT = 20
"""Failing probes listed in the message of a :class:`GradientCheckError` before "... and N more"."""


class GradientCheckError(RuntimeError):
    """Raised when a check finds gradients that disagree with the loss (``GradWatch(on_fail="raise")``).

    Attributes:
        report: The failing :class:`~gradwatch.CheckReport`.
    """

    def __init__(self, report: CheckReport) -> None:
        from gradwatch.engine.results.rendering import render_text  # the renderer reads reports: imported when raised

        super().__init__(render_text(report, limit=ERROR_LIMIT, prefix=""))
        self.report = report


class GradientCheckWarning(UserWarning):
    """Issued when a gradient check fails (``on_fail="warn"`` or ``"stop"``) or cannot run."""


class UnrestoredStateWarning(UserWarning):
    """A check could not put back something the loss changed (named in the message and in
    :attr:`CheckReport.unrestored`): the run is not exactly as it would have been without the check."""


class NoLossToCheckError(Exception):
    """Raised by a ``loss_fn`` that has no loss for this batch (a ``training_step`` that returned ``None``): the check
    is skipped, silently."""


class UnsupportedShardingError(ValueError):
    """The model's parameters are distributed in a way gradwatch does not check."""


class CheckAbandonedError(RuntimeError):
    """The check cannot go on and must end, whatever the loss does: the user's state could not be put back, or under
    sharded training another rank's evaluation failed. The places that fall back when the loss raises (a smaller
    slice, no vectorised pass, no input probes) let it through."""


class RestoreError(CheckAbandonedError):
    """Putting the user's state back failed (never mistaken for an error of the loss)."""


class LossCallsBackwardError(CheckAbandonedError, ValueError):
    """``loss_fn`` called ``backward()`` itself (a parameter's ``.grad`` changed while gradwatch evaluated it)."""


class CheckOutOfMemoryError(CheckAbandonedError):
    """The device ran out of memory during a check's evaluation: the check ends (its report says so), training goes on;
    no fallback of the check tries something else with the memory that is not there."""


class PeerFailureError(CheckAbandonedError):
    """A rank's evaluation raised, or a reduction across the ranks failed: the check ends on every rank."""


class LossCollectivesError(CheckAbandonedError):
    """The loss of a per-rank check called collectives: the check ends on every rank (each at the same evaluation)."""


class RaisedOnAnotherRankError(RuntimeError):
    """Raised on every process by :func:`~gradwatch.watch.distributed.agree_across_ranks` when the check raised on
    another one (``on_fail="raise"``): the same raise, so it passes every guard (:mod:`gradwatch.watch.guard`) as the
    original does."""


class UnfaithfulFloat64Error(Exception):
    """The loss on float64 storage is not the model's loss; the message says how it differs."""


class HeldValuesError(RuntimeError):
    """A differentiated evaluation of the loss (a second reference) detached other tensors than the reference pass."""


class OutsideTreeError(Exception):
    """The loss used a parameter that a substitution could not reach: it holds it outside the module tree."""


class ExhaustedError(Exception):
    """The culprit search made its maximum number of probes."""


class ReplayError(RuntimeError):
    """The optimizer's class could not be built again over a copy of the parameter, or its step raised."""


class InputsRefusedError(Exception):
    """The loss raised at displaced inputs: an input that is also a target in [0, 1] (an autoencoder's
    ``binary_cross_entropy(recon, x)``), a probability, a mask or a label stored as floats. The check drops its input
    probes, never the check (:func:`gradwatch.engine.recomputed.probes.measured_probes`)."""


class NotReproducibleError(Exception):
    """The loss at an applied check's centre, evaluated again, is not the differentiated loss (the probes say so and
    probe nothing)."""

    def __init__(self, center: float) -> None:
        super().__init__(center)
        self.center = center


class ReportInputError(Exception):
    """The log directory or its records cannot give a report (missing, unreadable, malformed, without gradwatch
    data); the message names the path and the reason in one line."""


class MissingExtraError(Exception):
    """An optional dependency is needed and not installed."""


OWN_ERRORS = (AttributeError, NameError, AssertionError)
"""The programming errors that, raised in gradwatch's own code, are a bug of gradwatch's (a name or attribute that is
not there, a broken invariant); a ``TypeError`` or ``ValueError`` there may be torch refusing a user's tensor."""

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


def own_error(error: BaseException) -> bool:
    """Whether ``error``, caught in gradwatch, is a bug of gradwatch's own rather than a failure of the code a check
    runs: one of :data:`OWN_ERRORS`, raised in gradwatch's code (or in torch's, called from there: an ``nn.Module``
    attribute that is not there), with no frame of any other code (the user's loss or model, a library's) between the
    place that caught it and the place that raised it; torch's and the standard library's frames are neither. The
    places that turn the user's failures into notes let such an error through, so that it is seen (in tests, and as
    the watch's guard reports it) instead of becoming a note."""
    if not isinstance(error, OWN_ERRORS):
        return False
    files = []
    frame = error.__traceback__
    while frame is not None:
        name = frame.tb_frame.f_code.co_filename
        files.append(name if name.startswith("<") else os.path.abspath(name))
        frame = frame.tb_next
    import torch  # imported by every caller already

    torch_directory = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    ours = [file for file in files if file.startswith(_PACKAGE)]
    innermost = next((file for file in reversed(files) if not file.startswith(torch_directory)), None)
    return bool(ours) and innermost == ours[-1] and all(_neutral(file, torch_directory) for file in files)


def _neutral(file: str, torch_directory: str) -> bool:
    """Whether a frame of ``file`` is gradwatch's, torch's or the standard library's (not the user's code)."""
    if file.startswith((_PACKAGE, torch_directory, "<frozen ")):
        return True
    return file.startswith(_STDLIB) and not any(part in file for part in ("site-packages", "dist-packages"))


def passes_fallbacks(error: BaseException) -> bool:
    """Whether ``error`` passes the places that turn the loss or model refusing something into a note (a smaller slice,
    no input probes, no culprit search, ...): a check that must end (:class:`CheckAbandonedError`), or a bug of
    gradwatch's own (:func:`own_error`)."""
    return isinstance(error, CheckAbandonedError) or own_error(error)
