"""The loop-agnostic watch: :class:`GradientWatch` turns single checks of the engine, of both kinds, into the monitoring
of a run (schedule and budget, rotation and focus, alerts and their backoff, counters, checkpoint state), in any
training loop. The adapters (:mod:`gradwatch.integrations.lightning`, :mod:`gradwatch.integrations`) sit above it; it
imports no framework."""

from gradwatch.outputs.sinks import Sink
from gradwatch.watch.alerts import GradientCheckWarning
from gradwatch.watch.hooks import NoLossToCheckError
from gradwatch.watch.watch import GradientWatch

__all__ = ["GradientCheckWarning", "GradientWatch", "NoLossToCheckError", "Sink"]
