"""gradwatch: checks, during real training runs, that the gradients a model trains on are the true derivatives of
its loss.

The package is layered; each layer imports only from those before it:

* :mod:`gradwatch.engine`: pure PyTorch, the whole of :func:`check_gradients`;
* :mod:`gradwatch.tensorboard`: check reports to TensorBoard and back;
* :mod:`gradwatch.lightning`: the :class:`GradWatch` callback and its alerts;
* the faces: :mod:`gradwatch.cli` (``gradwatch demo``, ``gradwatch report``) and :mod:`gradwatch.testing`.
"""

from gradwatch.engine import CheckReport, GradientCheckError, Probe, check_gradients
from gradwatch.lightning import GradientCheckWarning, GradWatch

__all__ = ["CheckReport", "GradWatch", "GradientCheckError", "GradientCheckWarning", "Probe", "check_gradients"]
__version__ = "0.1.0"
