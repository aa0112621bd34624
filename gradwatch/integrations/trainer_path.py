"""How a Hugging Face ``Trainer`` turns a window of micro-batches into the gradient it applies, for the applied check:
how its ``training_step`` combines the micro-batch losses (:func:`trainer_combine`), the window's samples as one batch
(:func:`joined_inputs`), the path its forward runs on under mixed precision, and one micro-batch's loss as it weighs
in the window: all of it one :class:`TrainerPath`, which gives the watch a loss and a
:class:`~gradwatch.watch.hooks.TrainingPath`.

Under mixed precision Accelerate wraps the model's ``forward`` itself in autocast (the unwrapped one kept as
``model._original_forward``), so every call of the model would run under autocast, the check's reference evaluations
too, which must run without it. During an applied check :class:`TrainerPath` puts the unwrapped ``forward`` on the
model, and the path's context puts Accelerate's wrapper back for the evaluations on the training's path, which then run
exactly as training did: the forward under autocast, its outputs converted to float32, the loss after the forward (a
label smoother, a ``compute_loss_func``) outside autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from gradwatch.engine.applied.equivalence import concatenate
from gradwatch.engine.applied.window import Combine, PathContext
from gradwatch.engine.function.evaluation import LossFn
from gradwatch.watch.hooks import TrainingPath

__all__ = [
    "TrainerPath",
    "divides_by_count",
    "joined_inputs",
    "scaled_for_window",
    "trainer_combine",
    "trainer_join",
    "window_share",
]


def joined_inputs(items: list[tuple[dict[str, Any], Any]]) -> tuple[dict[str, Any], Any]:
    """A window's recorded items ``(inputs, num_items_in_batch)`` as one batch, for the accumulation comparison: the
    inputs concatenated (:func:`~gradwatch.engine.applied.equivalence.concatenate`), with the count the Trainer passed,
    the whole window's (``get_batch_samples``): a loss divided by it is then the same function of the one batch as of
    the window, and a loss that averages over its own micro-batch is not. ``ValueError`` when the micro-batches were
    given different counts (a loop that counts per micro-batch)."""
    count = items[0][1]
    for _, other in items[1:]:
        same = torch.equal(torch.as_tensor(other), torch.as_tensor(count)) if count is not None else other is None
        if not same:
            raise ValueError("the micro-batches were given different num_items_in_batch")
    return concatenate([inputs for inputs, _ in items]), count


PAIRED_TRAINERS = frozenset({"DPOTrainer"})
"""Trainers whose micro-batch holds pairs as two halves (TRL's ``DataCollatorForPreference``: the chosen sequences, then
the rejected ones, and the loss splits its rows in half): a window joined as one batch keeps every pair's halves
apart (:func:`trainer_join`)."""


def trainer_join(trainer: Any) -> Callable[[list[tuple[dict[str, Any], Any]]], tuple[dict[str, Any], Any]]:
    """How a Trainer's window is joined into one batch for the accumulation comparison: :func:`joined_inputs`, or for
    a trainer of :data:`PAIRED_TRAINERS` the same with each micro-batch's halves joined apart (all chosen halves, then
    all rejected ones), since concatenating ``[c1, r1]`` and ``[c2, r2]`` would pair ``c1`` with ``c2``."""
    if not any(cls.__name__ in PAIRED_TRAINERS for cls in type(trainer).__mro__):
        return joined_inputs

    def join(items: list[tuple[dict[str, Any], Any]]) -> tuple[dict[str, Any], Any]:
        halves = [_halves(inputs) for inputs, _ in items]
        first, _ = joined_inputs([(h[0], count) for h, (_, count) in zip(halves, items, strict=True)])
        second, count = joined_inputs([(h[1], count) for h, (_, count) in zip(halves, items, strict=True)])
        # a split tensor's first-half rows, then its second-half rows, padded to one length as concatenate pads
        joined = {
            key: concatenate([{key: first[key]}, {key: second[key]}])[key] for key in first if second[key] is not None
        }
        return {**first, **joined}, count

    return join


def _halves(inputs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A paired micro-batch as its first and second halves: its tensors of twice the pair count split in two, the
    others (per-pair values such as ``ref_chosen_logps``, non-tensors) kept whole in the first half."""
    rows = [v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    pairs = max(rows, default=0) // 2
    if not pairs or any(r not in (pairs, 2 * pairs) for r in rows):
        raise ValueError("a paired micro-batch whose tensors are not of one or two rows per pair")
    first: dict[str, Any] = {}
    second: dict[str, Any] = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == 2 * pairs:
            first[key], second[key] = value[:pairs], value[pairs:]
        else:
            first[key], second[key] = value, None
    return first, second


def scaled_for_window(trainer: Trainer, num_items_in_batch: Any) -> bool:
    """Whether the Trainer takes each micro-batch's ``compute_loss`` as already normalised over the whole window (its
    ``loss_is_scaled_for_ga``, else a model taking loss kwargs given the count, or a ``compute_loss_func``), as its
    ``training_step`` decides before dividing by the accumulation steps."""
    scaled = trainer.loss_is_scaled_for_ga
    if scaled is None:
        accepts = bool(getattr(trainer, "model_accepts_loss_kwargs", False))
        scaled = (accepts and num_items_in_batch is not None) or trainer.compute_loss_func is not None
    return bool(scaled)


def trainer_combine(trainer: Trainer, num_items_in_batch: Any) -> Combine:
    """How ``trainer.training_step`` combines a window's micro-batch losses into the gradient: their sum when each is
    already normalised over the window (:func:`scaled_for_window`), else their mean; then divided by the accelerator's
    own accumulation steps (1 as the Trainer sets it up; under DeepSpeed none: the Trainer says
    ``scale_wrt_gas=False``)."""
    scaled = scaled_for_window(trainer, num_items_in_batch)
    deepspeed = bool(getattr(trainer, "is_deepspeed_enabled", False))
    divisor = 1 if deepspeed else int(getattr(trainer.accelerator, "gradient_accumulation_steps", 1))
    if divisor == 1:
        return "sum" if scaled else "mean"

    def combine(losses: list[torch.Tensor]) -> torch.Tensor:
        total = torch.stack(losses).sum()
        return (total if scaled else total / len(losses)) / divisor

    return combine


def window_share(trainer: Trainer, inputs: Mapping[str, Any], num_items_in_batch: Any) -> float:
    """The weight of one micro-batch's own mean loss in the loss the Trainer differentiates, for a user's ``loss_fn``
    (never given the window's count) when the Trainer's loss is normalised over the window (:func:`scaled_for_window`):
    the micro-batch's count of labelled items (``shift_labels``, else ``labels[..., 1:]`` for a causal LM's shifted
    loss, else ``labels``; not ``-100``) over the window's ``num_items_in_batch``, times the processes the Trainer
    multiplies by when it averages the tokens across devices. A micro-batch's token mean weighted so is the window's
    token mean the Trainer trains on. ``1.0`` when the inputs carry no labels or the Trainer passed no count (such a
    loss is taken as normalised over the window already, as a GRPO-style loss divides by the count its inputs carry)."""
    labels = inputs.get("shift_labels")
    if labels is None:
        labels = inputs.get("labels")
        if isinstance(labels, torch.Tensor) and getattr(trainer, "_loss_shifts_labels", False):
            labels = labels[..., 1:]
    if num_items_in_batch is None or not isinstance(labels, torch.Tensor):
        return 1.0
    window = float(torch.as_tensor(num_items_in_batch).float().sum())
    if window <= 0:
        return 1.0
    processes = 1
    if getattr(trainer.args, "average_tokens_across_devices", False) and trainer.args.world_size > 1:
        processes = int(trainer.accelerator.num_processes) // int(trainer.get_tp_size())
    return float(labels.ne(-100).sum()) * processes / window


class TrainerPath:
    """How ``trainer`` trains on the window just run, for the applied check of ``model`` (``trainer.model``; see the
    module's docstring): ``loss_with_count(num_items_in_batch)`` is its own ``compute_loss`` as a ``loss_fn``,
    ``loss_fn`` the user's instead (or ``None``), ``count`` the ``num_items_in_batch`` it passed with the window's
    micro-batches and ``first`` the inputs of the first (``None`` if none was recorded)."""

    def __init__(
        self,
        trainer: Trainer,
        model: nn.Module,
        loss_with_count: Callable[[Any], LossFn],
        loss_fn: LossFn | None = None,
        *,
        count: Any = None,
        first: dict[str, Any] | None = None,
    ) -> None:
        self.trainer, self.model = trainer, model
        self.loss_with_count, self.loss_fn = loss_with_count, loss_fn
        self.count, self.first = count, first
        self.mixed = getattr(trainer.accelerator, "mixed_precision", "no") != "no"
        own = vars(model)
        wrapped = own.get("forward") if "_original_forward" in own else None
        self._wrapped: Callable[..., Any] | None = wrapped if callable(wrapped) else None
        self._unwrapped: Callable[..., Any] | None = own.get("_original_forward") if self._wrapped else None

    def training(self) -> TrainingPath:
        """The window's training path for the watch: combined as ``training_step`` combines it, on the forward's path,
        joined as one batch with the window's count, and normalised over the window when ``compute_loss`` divides by
        its count (:func:`divides_by_count`, asked only when the window's gradient looks normalised twice)."""

        def normalised() -> bool:
            first = self.first
            return first is not None and divides_by_count(
                self.loss_with_count, self.model, first, self.count, self.loss_context
            )

        combine = trainer_combine(self.trainer, self.count)
        return TrainingPath(combine, self.path, trainer_join(self.trainer), normalised)

    def loss(self, model: nn.Module, batch: tuple[dict[str, Any], Any]) -> torch.Tensor:
        """One recorded micro-batch's loss, as the Trainer's ``training_step`` computes it (before its division): its
        ``compute_loss`` with the count it passed, or the user's ``loss_fn`` (a mean over its own micro-batch)
        weighted as the Trainer's window-normalised loss weighs it (:func:`window_share`)."""
        inputs, num_items_in_batch = batch
        with self.loss_context():
            if self.loss_fn is None:
                return self.loss_with_count(num_items_in_batch)(model, inputs)
            loss = self.loss_fn(model, inputs)
        if not scaled_for_window(self.trainer, num_items_in_batch):
            return loss
        return loss * window_share(self.trainer, inputs, num_items_in_batch)

    @property
    def path(self) -> PathContext | None:
        """The context factory of the training's path (``None`` without mixed precision): the Trainer's
        ``compute_loss_context_manager``, the accelerator's autocast (which the check reads its dtype from) and
        Accelerate's wrapped ``forward``."""
        if not self.mixed:
            return None

        def path() -> contextlib.AbstractContextManager[Any]:
            stack = contextlib.ExitStack()
            stack.enter_context(self.trainer.compute_loss_context_manager())
            stack.enter_context(self.trainer.accelerator.autocast())
            if self._wrapped is not None:
                stack.enter_context(self._forward(self._wrapped))
            return stack

        return path

    def unwrapped(self) -> contextlib.AbstractContextManager[Any]:
        """For the duration of a check: the model's ``forward`` without Accelerate's autocast (nothing to do when it
        has none)."""
        if self._unwrapped is None:
            return contextlib.nullcontext()
        return self._forward(self._unwrapped)

    def loss_context(self) -> contextlib.AbstractContextManager[Any]:
        """Around one micro-batch's ``compute_loss``: autocast off, as the Trainer leaves it around the model's call
        (the wrapped ``forward`` turns it on for the forward alone). Without Accelerate's wrapper (a model it did not
        wrap, under DDP its wrapper), the whole loss runs in the path's autocast."""
        if self._wrapped is None:
            return contextlib.nullcontext()
        return torch.autocast(self.trainer.args.device.type, enabled=False)

    @contextlib.contextmanager
    def _forward(self, forward: Callable[..., Any]) -> Iterator[None]:
        saved = vars(self.model)["forward"]
        self.model.forward = forward  # type: ignore[method-assign]
        try:
            yield
        finally:
            self.model.forward = saved  # type: ignore[method-assign]


COUNT_KEY = "num_items_in_batch"
"""Where TRL's GRPO-family trainers keep the window's count of completion tokens in the inputs, besides the Trainer's
own argument of that name."""


def divides_by_count(
    loss_with_count: Callable[[Any], Callable[[nn.Module, dict[str, Any]], torch.Tensor]],
    model: nn.Module,
    inputs: dict[str, Any],
    count: Any,
    context: Callable[[], contextlib.AbstractContextManager[Any]],
) -> bool:
    """Whether a Trainer's loss divides by the window's ``num_items_in_batch`` (a DAPO-style loss, a model taking loss
    kwargs): given twice the count (as the Trainer's argument or the inputs' key of that name), the loss of ``inputs``
    halves. Two forwards without gradient in eval mode, inside ``context()``, the random state and modes put back."""
    if count is None and COUNT_KEY not in inputs:
        return False
    modes = [(module, module.training) for module in model.modules()]
    values = []
    try:
        model.eval()
        for factor in (1, 2):
            with torch.random.fork_rng(devices=[]), torch.no_grad(), context():
                torch.manual_seed(0)
                given = {**inputs, COUNT_KEY: inputs[COUNT_KEY] * factor} if COUNT_KEY in inputs else inputs
                values.append(float(loss_with_count(None if count is None else count * factor)(model, given)))
    finally:
        for module, training in modes:
            module.training = training
    whole, doubled = values
    return 0 < abs(whole) < float("inf") and abs(2 * doubled - whole) <= 1e-3 * abs(whole)
