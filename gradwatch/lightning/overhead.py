"""Old import path, kept: ``gradwatch.lightning.overhead`` is now :mod:`gradwatch.watch.overhead`."""

from gradwatch.watch.overhead import OverheadClock

__all__ = ["OverheadClock"]
