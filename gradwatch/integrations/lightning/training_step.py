"""The loss a check evaluates for a LightningModule: its own ``training_step``, made safe to call again and again.

A check calls the loss dozens of times. ``training_step`` logs (its ``self.log`` calls would overwrite the run's real
metrics with perturbed values), may return ``None`` or a dict,. :func:`training_step_loss` silences the module's
logging and unpacks the output; :func:`loggers_silenced` silences the loggers themselves for the duration of a check.
The applied check's items are ``(batch, batch_idx)``; :func:`joined_window` makes a window of them one batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor, nn

from gradwatch.engine import LossFn
from gradwatch.engine.applied.equivalence import concatenate
from gradwatch.watch.hooks import NoLossToCheckError  # training_step returned None: no loss to check

__all__ = ["NoLossToCheckError", "joined_window", "loggers_silenced", "training_step_loss"]


@contextlib.contextmanager
def _replaced(obj: object, name: str, value: Any) -> Iterator[None]:
    """``obj.name`` is ``value`` (an instance attribute, shadowing a method), then exactly what was there before."""
    had, saved = name in vars(obj), vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, saved)
        else:
            delattr(obj, name)


def _silenced(obj: object, names: Iterable[str]) -> contextlib.ExitStack:
    """Make the methods ``names`` of ``obj`` do nothing, then put back exactly what was there."""
    stack = contextlib.ExitStack()
    for name in names:
        if callable(getattr(obj, name, None)):
            stack.enter_context(_replaced(obj, name, lambda *args, **kwargs: None))
    return stack


def _logging_silenced(module: pl.LightningModule) -> contextlib.ExitStack:
    """Make ``module.log``/``module.log_dict`` do nothing, so probes do not overwrite the run's real metrics (also
    when they log a torchmetrics object, or with ``sync_dist=True``: no collective runs)."""
    return _silenced(module, ("log", "log_dict"))


_LOGGER_METHODS = ("log_metrics", "log_hyperparams", "log_graph")
_EXPERIMENT_PREFIXES = ("add_", "log")


@contextlib.contextmanager
def loggers_silenced(module: nn.Module) -> Iterator[None]:
    """During a check of ``module`` (a LightningModule in a fit), make its trainer's loggers write nothing:
    ``training_step`` may call ``self.logger.log_metrics(...)`` or ``self.logger.experiment.add_image(...)`` itself, and
    the probes' calls are not training steps. The experiments already created (a TensorBoard ``SummaryWriter``, a W&B
    run) lose their ``add_*`` and ``log*`` methods for the duration; none is created for it. The watch's ``context``."""
    trainer: pl.Trainer = module.trainer  # type: ignore[assignment]
    with contextlib.ExitStack() as stack:
        for logger in trainer.loggers:
            stack.enter_context(_silenced(logger, _LOGGER_METHODS))
            experiment = getattr(logger, "_experiment", None)
            if experiment is not None:
                names = [name for name in dir(experiment) if name.startswith(_EXPERIMENT_PREFIXES)]
                stack.enter_context(_silenced(experiment, names))
        yield


def training_step_loss(module: pl.LightningModule, batch_idx: int) -> LossFn:
    """A ``loss_fn`` that calls ``module.training_step`` on the batch, with its logging silenced.

    ``training_step`` is called as Lightning calls it (with ``batch_idx`` if its signature takes one). It may return the
    loss tensor or a dict with a ``"loss"`` entry; ``None`` skips the check."""
    extra: list[tuple[int, ...]] = []  # the signature read at the first call, not at every step this loss is built

    def loss_fn(_model: nn.Module, batch: Any) -> Tensor:  # called with ``module`` itself
        if not extra:
            takes = is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2)
            extra.append((batch_idx,) if takes else ())
        with _logging_silenced(module):
            output = module.training_step(batch, *extra[0])
        if output is None:
            raise NoLossToCheckError
        if isinstance(output, Mapping):
            if "loss" not in output:
                raise ValueError(f"training_step returned a dict without a 'loss' key (keys: {sorted(output)})")
            output = output["loss"]
        return output

    return loss_fn


def joined_window(items: list[tuple[Any, int]]) -> tuple[Any, int]:
    """A window's recorded items ``(batch, batch_idx)`` as one, for the comparison of the accumulated gradient with the
    window's samples taken as one batch: the batches concatenated
    (:func:`~gradwatch.engine.applied.equivalence.concatenate`: tensors, tuples and dicts of them, token tensors of
    different lengths padded), with the first micro-batch's index, which ``training_step`` is given beside the data."""
    return concatenate([batch for batch, _ in items]), items[0][1]
