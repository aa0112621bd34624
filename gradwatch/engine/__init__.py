"""The engine of gradwatch: pure PyTorch, no Lightning and no TensorBoard.

:func:`check_gradients` checks one model on one batch and returns a :class:`CheckReport`. Its parts, lowest layer
first (each imports only from the layers below it):

* :mod:`.kinds`, :mod:`.notes`, :mod:`.report` and :mod:`.validation`: probe kinds (with the table of their
  properties), verdicts, reasons and note codes as enums, results as data, argument checks;
* :mod:`.sharding`: the reductions across the ranks of a sharded (FSDP2) check, the identity everywhere else;
* :mod:`.numerics`: steps, tolerances, stencils and their verdicts, norms;
* :mod:`.function`: the loss as one deterministic function (batch structure, state snapshot and restore, float64
  storage and reductions, probe conditions, the evaluator);
* :mod:`.measuring`: directions and displacements, vectorised passes, the points probes ask for;
* :mod:`.probing`: the portfolio of probes, the escalation ladder, sampling;
* :mod:`.session`, :mod:`.reference` and :mod:`.check`: what every check does around its measurements (the check
  session), the reference gradient and the recomputed check's measurements; :mod:`.applied`: the applied check's.
"""

from gradwatch.engine.function.evaluation import LossFn
from gradwatch.engine.recomputed.check import check_gradients
from gradwatch.engine.results.report import CheckReport, GradientCheckError, Probe

__all__ = ["CheckReport", "GradientCheckError", "LossFn", "Probe", "check_gradients"]
