"""Old import path, kept: ``gradwatch.lightning.schedule`` is now :mod:`gradwatch.watch.schedule`."""

from gradwatch.watch.schedule import Schedule

__all__ = ["Schedule"]
