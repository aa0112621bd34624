"""The update check: the update ``optimizer.step()`` applied, against a reference update from the verified gradient
(:func:`check_update`, what it keeps before the step: :class:`UpdateSnapshot`)."""

from gradwatch.engine.update.algorithms import Reference, reference_for
from gradwatch.engine.update.check import check_update
from gradwatch.engine.update.snapshot import UpdateSnapshot, update_tensors

__all__ = ["Reference", "UpdateSnapshot", "check_update", "reference_for", "update_tensors"]
