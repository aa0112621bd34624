"""The engine of gradwatch: pure PyTorch, no Lightning and no TensorBoard.

:func:`check_gradients` checks one model on one batch and returns a :class:`CheckReport`;
:func:`~gradwatch.engine.applied.check_applied_gradient` checks the gradient the optimizer applies, and
:func:`~gradwatch.engine.update.check_update` the update it makes. Its parts, lowest layer first (each imports only
from the layers below it; ``docs/architecture.md`` says what each holds):

* :mod:`.results` and :mod:`.validation`: the vocabulary of results (the table of probe kinds, verdicts, reasons and
  note codes as enums, :class:`Probe` and :class:`CheckReport`, the one rendering of a failing report), argument
  checks;
* :mod:`.distributed`: the reductions across the ranks of a sharded check, parameters made whole for it;
* :mod:`.numerics`: steps, tolerances, stencils and their verdicts, norms;
* :mod:`.function`: the loss as one deterministic function (batch structure, state snapshot and restore, float64
  storage and reductions, probe conditions, the evaluator, a check's memory);
* :mod:`.measuring`: directions and displacements, vectorised passes, the points probes ask for;
* :mod:`.probing`: the portfolio of probes, the escalation ladder, the plan of a check;
* the checks: :mod:`.settings` (the probe options), :mod:`.selection` (which parameters), :mod:`.session` (what every
  check does around its measurements), :mod:`.culprits` (the search for the module whose backward is wrong),
  :mod:`.recomputed`, :mod:`.applied` and :mod:`.update` (the three kinds of check).
"""

from gradwatch.engine.function.evaluation import LossFn
from gradwatch.engine.recomputed.check import check_gradients
from gradwatch.engine.results.findings import AppliedFindings
from gradwatch.engine.results.report import CheckReport, GradientCheckError, Probe

__all__ = ["AppliedFindings", "CheckReport", "GradientCheckError", "LossFn", "Probe", "check_gradients"]
