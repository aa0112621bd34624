"""Old import path, kept: ``gradwatch.callback`` is now :mod:`gradwatch.lightning.callback`."""

from gradwatch.lightning.callback import GradWatch
from gradwatch.lightning.publishing import PROGRESS_BAR_KEY, progress_status
from gradwatch.lightning.training_step import training_step_loss

__all__ = ["PROGRESS_BAR_KEY", "GradWatch", "progress_status", "training_step_loss"]
