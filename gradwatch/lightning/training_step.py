"""The loss a check evaluates for a LightningModule: its own ``training_step``, made safe to call again and again.

A check calls the loss dozens of times. ``training_step`` logs (its ``self.log`` calls would overwrite the run's real
metrics with perturbed values), may return ``None`` or a dict, and a ``SyncBatchNorm`` inside it would run collectives
that every process must join. :func:`training_step_loss` silences the logging and unpacks the output;
:func:`local_batch_norm` makes ``SyncBatchNorm`` normalise with this process's statistics for the duration.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor, nn

from gradwatch.engine import LossFn


class NoLossToCheckError(Exception):
    """``training_step`` returned ``None`` for the checked batch: there is no loss to check."""


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _logging_silenced(module: pl.LightningModule) -> Iterator[None]:
    """Make ``module.log``/``module.log_dict`` do nothing, so probes do not overwrite the run's real metrics."""
    saved = {name: module.__dict__[name] for name in ("log", "log_dict") if name in module.__dict__}
    module.log = _noop  # type: ignore[method-assign]
    module.log_dict = _noop  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            if name in saved:
                setattr(module, name, saved[name])
            else:
                delattr(module, name)


@contextlib.contextmanager
def local_batch_norm(module: nn.Module) -> Iterator[None]:
    """Let every ``SyncBatchNorm`` compute its statistics from this process's batch alone during a check.

    SyncBatchNorm runs collectives inside forward: synchronized probes would need every process to run exactly the same
    sequence of forwards, while each process's check takes its own data-dependent path (confirmations, retries). Its
    backward also returns, on each process, the gradient of the sum of all processes' losses, not of the local one.
    With local statistics each process checks a self-contained function of its own batch, and runs no collective.
    """
    patched = [m for m in module.modules() if isinstance(m, nn.SyncBatchNorm)]
    saved = [m.__dict__.get("forward") for m in patched]
    for m in patched:
        m.forward = types.MethodType(nn.BatchNorm1d.forward, m)  # type: ignore[method-assign]  # local statistics
    try:
        yield
    finally:
        for m, forward in zip(patched, saved, strict=True):
            if forward is None:
                del m.forward
            else:
                m.forward = forward  # type: ignore[method-assign]


def training_step_loss(module: pl.LightningModule, batch_idx: int) -> LossFn:
    """A ``loss_fn`` that calls ``module.training_step`` on the batch, with its logging silenced.

    ``training_step`` is called as Lightning calls it (with ``batch_idx`` if its signature takes one). It may return
    the loss tensor or a dict with a ``"loss"`` entry; ``None`` skips the check.
    """
    extra = (batch_idx,) if is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2) else ()

    def loss_fn(_model: nn.Module, batch: Any) -> Tensor:  # called with ``module`` itself
        with _logging_silenced(module):
            output = module.training_step(batch, *extra)
        if output is None:
            raise NoLossToCheckError
        if isinstance(output, Mapping):
            if "loss" not in output:
                raise ValueError(f"training_step returned a dict without a 'loss' key (keys: {sorted(output)})")
            output = output["loss"]
        return output

    return loss_fn
