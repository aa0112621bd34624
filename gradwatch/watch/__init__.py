"""The loop-agnostic watch: :class:`GradientWatch` turns single checks of the engine into the monitoring of a run
(schedule and budget, rotation and focus, alerts and their backoff, counters, checkpoint state), in any training loop.
The adapters (:mod:`gradwatch.lightning`, :mod:`gradwatch.integrations`) sit above it; it imports no framework."""

from gradwatch.watch.alerts import GradientCheckWarning
from gradwatch.watch.watch import GradientWatch, NoLossToCheckError, Sink

__all__ = ["GradientCheckWarning", "GradientWatch", "NoLossToCheckError", "Sink"]
