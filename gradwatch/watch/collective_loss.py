"""The recomputed check of a DDP loss that calls collectives (a contrastive loss's ``GatherLayer``, an
``all_reduce`` of a metric): the global loss, evaluated by every rank together.

Under DDP each process checks its own batch shard (:mod:`.distributed`): its own loss, its own probe points, its own
decisions. A loss with collectives inside breaks both halves of that. The gradient a rank's backward computes is not
the derivative of its own loss (a gather's backward adds the other ranks' losses' share of this rank's embeddings),
so a correct layer fails; and each rank's probes, decided on its own numbers, run the collectives in a different order
from the others', which can hang. So the watch counts the collectives of the default process group while the
per-rank check runs (:class:`CollectiveCounter`): they are the same on every rank up to the end of the first
evaluation, forward and backward; if the loss issued any, every rank abandons the per-rank check at its next
evaluation, and the check becomes :func:`global_check`: this step's gradient recomputed on every rank and averaged as
DDP averages it, against central differences of the mean of the ranks' losses, every evaluation on every rank in
lockstep at the same probe point (:func:`gradwatch.check_applied_gradient` with the process group, whose decisions
rest on numbers the same on every rank). A gradient right for the local loss and wrong for the global one fails.

Collectives of another process group than the default one are not counted (the per-rank check then runs as before);
where a process group cannot count its collectives (no sequence numbers), neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradwatch.engine import CheckReport, LossFn, check_gradients
from gradwatch.engine.applied import check_applied_gradient
from gradwatch.engine.function.state import capture_rng
from gradwatch.engine.probing.search_budget import SearchBudget
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.settings import ProbeSettings
from gradwatch.errors import LossCollectivesError


def _sequence(group: Any) -> int | None:
    """How many collectives ``group`` has run so far (``None`` where it cannot say)."""
    try:
        return int(group._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return None


def counted_group(model: nn.Module) -> Any:
    """The process group whose collectives the per-rank check of ``model`` counts: the default one of a run of several
    processes, for a model wrapped in ``DistributedDataParallel`` (a plain loop's); else ``None``. The adapters pass
    the bare module (Lightning's), whose per-rank checks keep their behaviour: a rank raising alone there ends the
    check on that rank only, and a global check would wait for it."""
    if not isinstance(model, DistributedDataParallel):
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.distributed_c10d._get_default_group()


class CollectiveCounter:
    """``loss_fn``, counting the collectives of ``group`` from the first call on: a call made after any ran raises
    :class:`LossCollectivesError` (the per-rank check issues no collective of its own, so they are the loss's)."""

    def __init__(self, loss_fn: LossFn, group: Any) -> None:
        self.loss_fn, self.group = loss_fn, group
        self.start = _sequence(group)
        self.calls = 0
        self.issued = 0

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.start is not None and self.calls:
            now = _sequence(self.group)
            if now is not None and now != self.start:
                self.issued = now - self.start
                raise LossCollectivesError(f"the loss calls collectives ({self.issued} in its first evaluation)")
        self.calls += 1
        return self.loss_fn(model, batch)


def _mean_gradient(
    model: nn.Module, batch: Any, loss_fn: LossFn, group: Any, *, average: bool = True
) -> dict[str, torch.Tensor]:
    """The gradient of ``loss_fn`` at the current parameters, drawing from the random state of now, computed on every
    rank and averaged over ``group`` as DDP averages it (each rank's own without ``average``: a model split by hand);
    ``.grad``, DDP's reducer and the random state are left as they were."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    syncing = getattr(model, "no_sync", None)
    forward_sync = getattr(model, "require_forward_param_sync", None)  # a forward under no_sync clears it
    try:
        with torch.random.fork_rng(devices=[]), syncing() if callable(syncing) else contextlib.nullcontext():
            loss = loss_fn(model, batch)
            grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    finally:
        if forward_sync is not None:
            model.require_forward_param_sync = forward_sync
    parts = [(torch.zeros_like(p) if g is None else g).detach().reshape(-1).double()
             for (_, p), g in zip(named, grads, strict=True)]  # fmt: skip
    flat = torch.cat([*parts, torch.tensor([0.0 if g is None else 1.0 for g in grads], dtype=torch.float64)])
    if average:
        dist.all_reduce(flat, group=group)
    world = dist.get_world_size(group) if average else 1
    found, offset = {}, 0
    present = flat[-len(named) :]
    for i, (name, p) in enumerate(named):
        part = flat[offset : offset + p.numel()]
        offset += p.numel()
        if present[i] > 0:
            found[name] = (part / world).reshape(p.shape).to(p.dtype)
    return found


def global_check(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    group: Any,
    step: int,
    settings: ProbeSettings,
    optimizers: Sequence[torch.optim.Optimizer],
    issued: int,
) -> CheckReport:
    """The recomputed check of a loss with collectives inside, as the global loss every rank evaluates together."""
    drawn = capture_rng()  # the random numbers the gradient's forward draws, replayed by every evaluation
    gradients = _mean_gradient(model, batch, loss_fn, group)
    report = check_applied_gradient(model, [batch], loss_fn, gradients, group=group, step=step, settings=settings,
                                    optimizers=optimizers, compare_one_batch=False, rng_states=[drawn])  # fmt: skip
    text = (
        f"the loss calls collectives ({issued} in its first evaluation): a rank's own loss is not the function its "
        "gradient differentiates, so this step's gradient, recomputed on every rank and averaged as DDP averages it, "
        "was checked against the mean of the ranks' losses, every rank evaluating it together at the same points "
        "(the whole batch of each rank)"
    )
    return dataclasses.replace(report, scope="recomputed", notes=[Note(NoteCode.LOSS_COLLECTIVES, text), *report.notes])


def split_check(
    model: nn.Module, batch: Any, loss_fn: LossFn, *, group: Any, step: int, settings: ProbeSettings,
    optimizers: Sequence[torch.optim.Optimizer],
) -> CheckReport:  # fmt: skip
    """The recomputed check of a model split across the ranks by hand (:mod:`gradwatch.engine.applied.split`): this
    step's gradient recomputed on every rank, each its own part's, against the sum of the ranks' losses, every rank
    evaluating it together as the applied check of such a model does."""
    drawn = capture_rng()
    gradients = _mean_gradient(model, batch, loss_fn, group, average=False)
    report = check_applied_gradient(model, [batch], loss_fn, gradients, group=group, step=step, settings=settings,
                                    optimizers=optimizers, compare_one_batch=False, rng_states=[drawn])  # fmt: skip
    return dataclasses.replace(report, scope="recomputed")


def recomputed_check(
    model: nn.Module, batch: Any, loss_fn: LossFn, *, step: int, settings: ProbeSettings, rotation: int,
    focus: Sequence[str], optimizers: Sequence[torch.optim.Optimizer], search_budget: SearchBudget | None = None,
) -> CheckReport:  # fmt: skip
    """The watch's recomputed check of ``loss_fn``: :func:`~gradwatch.check_gradients`; for a model whose group's
    collectives are counted (:func:`counted_group`), one whose loss turned out to run collectives is checked again as
    the global loss (:func:`global_check`), every rank here at once."""
    group = counted_group(model)
    counted = CollectiveCounter(loss_fn, group) if group is not None else loss_fn
    try:
        return check_gradients(model, batch, counted, step=step, settings=settings, rotation=rotation, focus=focus,
                               optimizers=optimizers, search_budget=search_budget)  # fmt: skip
    except LossCollectivesError:
        assert isinstance(counted, CollectiveCounter)
        return global_check(model, batch, loss_fn, group=group, step=step, settings=settings, optimizers=optimizers,
                            issued=counted.issued)  # fmt: skip
