"""The engine of gradwatch: pure PyTorch, no Lightning and no TensorBoard.

:func:`check_gradients` checks one model on one batch and returns a :class:`CheckReport`;
:func:`~gradwatch.engine.applied.check_applied_gradient` checks the gradient the optimizer applies, and
:func:`~gradwatch.engine.update.check_update` the update it makes. Its parts, lowest layer first, each importing only
from the layers below it (``docs/architecture.md`` says what each holds): :mod:`.results` and :mod:`.validation`,
:mod:`.distributed`, :mod:`.numerics`, :mod:`.function`, :mod:`.measuring`, :mod:`.probing`, then the checks
(:mod:`.settings`, :mod:`.selection`, :mod:`.session`, :mod:`.culprits`, :mod:`.recomputed`, :mod:`.applied`,
:mod:`.update`).
"""

from gradwatch.engine.function.evaluation import LossFn
from gradwatch.engine.recomputed.check import check_gradients
from gradwatch.engine.results.findings import AppliedFindings
from gradwatch.engine.results.report import CheckReport, GradientCheckError, Probe

__all__ = ["AppliedFindings", "CheckReport", "GradientCheckError", "LossFn", "Probe", "check_gradients"]
