"""gradwatch: checks, during real training runs, that the gradients a model trains on are the true derivatives of
its loss."""

from gradwatch.alerts import GradientCheckWarning
from gradwatch.callback import GradWatch
from gradwatch.check import check_gradients
from gradwatch.report import CheckReport, GradientCheckError, Probe

__all__ = ["CheckReport", "GradWatch", "GradientCheckError", "GradientCheckWarning", "Probe", "check_gradients"]
__version__ = "0.1.0"
