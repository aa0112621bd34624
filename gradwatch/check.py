"""Old import path, kept: ``gradwatch.check`` is now :mod:`gradwatch.engine.check`."""

from gradwatch.engine.check import check_gradients

__all__ = ["check_gradients"]
