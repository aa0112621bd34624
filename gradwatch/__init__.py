"""gradwatch: checks, during real training runs, that the gradients a model trains on are the true derivatives of
its loss.

The package is layered; each layer imports only from those before it:

* :mod:`gradwatch.errors`: every exception and warning gradwatch defines;
* :mod:`gradwatch.engine`: pure PyTorch, the whole of :func:`check_gradients` and :func:`check_applied_gradient`;
* :mod:`gradwatch.tensorboard` and :mod:`gradwatch.outputs`: a check's records, to every logger and to the JSON lines
  record ``gradwatch report`` reads;
* :mod:`gradwatch.watch`: :class:`GradientWatch`, a series of checks over a run in any training loop;
* the adapters over the watch: :mod:`gradwatch.integrations.lightning` (the :class:`GradWatch` callback) and
  :mod:`gradwatch.integrations` (Hugging Face's ``Trainer``);
* the faces: :mod:`gradwatch.cli` (``gradwatch demo``, ``gradwatch report``) and :mod:`gradwatch.testing`.

``import gradwatch`` imports neither Lightning nor transformers: :class:`GradWatch` is imported (with Lightning) when
first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradwatch.engine import AppliedFindings, CheckReport, Probe, check_gradients
from gradwatch.engine.applied import AppliedWindow, check_applied_gradient
from gradwatch.engine.settings import ProbeSettings
from gradwatch.errors import GradientCheckError, GradientCheckWarning
from gradwatch.watch import GradientWatch

if TYPE_CHECKING:
    from gradwatch.integrations.lightning import GradWatch

__all__ = [
    "AppliedFindings",
    "AppliedWindow",
    "CheckReport",
    "GradWatch",
    "GradientCheckError",
    "GradientCheckWarning",
    "GradientWatch",
    "Probe",
    "ProbeSettings",
    "check_applied_gradient",
    "check_gradients",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # the Lightning adapter, imported (with Lightning) only by those who use it
    if name == "GradWatch":
        from gradwatch.integrations.lightning import GradWatch

        return GradWatch
    raise AttributeError(f"module 'gradwatch' has no attribute {name!r}")
