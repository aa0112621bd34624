"""The recomputed check of a loss that calls collectives (a contrastive loss's ``GatherLayer``, an ``all_reduce`` of a
metric) on ranks that hold replicas of one model (DDP, bare or wrapped): the global loss, evaluated by every rank
together.

Under DDP each process checks its own batch shard. A loss with collectives breaks that: a rank's gradient is not the
derivative of its own loss (a gather's backward adds the other ranks' share of this rank's embeddings), so a correct
layer fails; and each rank's probes, decided on its own numbers, run the collectives in a different order, which can
hang. So :func:`check_gradients <gradwatch.check_gradients>` counts the default process group's collectives while the
per-rank check runs (:class:`CollectiveCounter`, :func:`in_lockstep_for_collective_losses`); if the loss issued any
(the same on every rank in the first evaluation), every rank abandons the per-rank check at its next evaluation (or at
its end), the ranks agree in one reduction, and the check becomes :func:`global_check`: this step's gradient recomputed
on every rank and averaged as DDP averages it, against central differences of the mean of the ranks' losses, in
lockstep (:func:`gradwatch.check_applied_gradient` with the process group). A gradient right for the local loss and
wrong for the global one fails. A model split by hand is checked as :func:`split_check` checks it: each rank's own
part's gradient against the sum of the ranks' losses. A rank whose check raised after the loss's collectives makes
every rank's check end: it raises, the others report ``inconclusive`` with the reason.

Not counted: collectives of another process group; a group without sequence numbers; parameters a library lays out
(``DTensor`` under FSDP2, whose check is global already; tensor parallelism, whose check refuses a loss written for
the shards; DeepSpeed's engine or ZeRO, whose recomputed check stays per rank).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec

import torch
import torch.distributed as dist
from torch import nn

from gradwatch.engine.distributed import tensor_parallel, zero
from gradwatch.engine.distributed.collective import active as sharding_active
from gradwatch.engine.distributed.parameters import is_sharded
from gradwatch.engine.function.evaluation import LossFn
from gradwatch.engine.function.state import capture_rng
from gradwatch.engine.results.kinds import Verdict
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import CheckReport
from gradwatch.errors import LossCollectivesError

Options = ParamSpec("Options")

_TOGETHER: contextvars.ContextVar[bool] = contextvars.ContextVar("a check of the global loss runs", default=False)
"""Set while :func:`global_check` runs: a recomputed check asked for inside it (the applied check's culprit search)
is not made (it would differentiate a rank's own loss, and search again without end)."""


def _sequence(group: Any) -> int | None:
    """How many collectives ``group`` has run so far (``None`` where it cannot say)."""
    try:
        return int(group._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return None


def counted_group(model: nn.Module) -> Any:
    """The default process group of a run of several processes, whose collectives the per-rank check of ``model``
    counts, for a model whose parameters are whole, plain tensors (DDP's replicas, bare or wrapped); else ``None``."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if sharding_active() is not None or zero.is_engine(model) or is_sharded(list(model.named_parameters())):
        return None
    if tensor_parallel.replicas_group() is not None:  # made whole for a tensor-parallel check, which runs in lockstep
        return None
    if any(zero.owned_range(p) is not None for p in model.parameters()):
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

    def counted(self) -> int:
        """The collectives run since the counting began (0 where the group cannot say)."""
        now = _sequence(self.group)
        if self.start is not None and now is not None:
            self.issued = now - self.start
        return self.issued

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.calls and self.counted():
            raise LossCollectivesError(f"the loss calls collectives ({self.issued} in its first evaluation)")
        self.calls += 1
        return self.loss_fn(model, batch)


def _mean_gradient(
    model: nn.Module, batch: Any, loss_fn: LossFn, group: Any, *, average: bool = True
) -> dict[str, torch.Tensor] | None:
    """The gradient of ``loss_fn`` at the current parameters, from the random state of now, on every rank, averaged over
    ``group`` as DDP averages it (each rank's own without ``average``: a model split by hand); ``.grad``, DDP's reducer
    and the random state are left as they were. A rank where it raised raises after the reduction; the others get
    ``None``."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    syncing = getattr(model, "no_sync", None)
    forward_sync = getattr(model, "require_forward_param_sync", None)  # a forward under no_sync clears it
    grads: Sequence[torch.Tensor | None] = [None] * len(named)
    error = None
    try:
        with torch.random.fork_rng(devices=[]), syncing() if callable(syncing) else contextlib.nullcontext():
            loss = loss_fn(model, batch)
            grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    except Exception as raised:  # the reduction below goes on, so that no other rank waits for this one
        error = raised
    finally:
        if forward_sync is not None:
            model.require_forward_param_sync = forward_sync
    parts = [(torch.zeros_like(p) if g is None else g).detach().reshape(-1).double()
             for (_, p), g in zip(named, grads, strict=True)]  # fmt: skip
    flags = [0.0 if g is None else 1.0 for g in grads] + [1.0 if error is not None else 0.0]
    flat = torch.cat([*parts, torch.tensor(flags, dtype=torch.float64)])
    failed = torch.tensor([flat[-1].item()])
    if average:
        dist.all_reduce(flat, group=group)
    else:  # each rank's own part: only whether a rank raised goes across
        dist.all_reduce(failed, group=group)
    if error is not None:
        raise error
    if float(failed if not average else flat[-1]) > 0:
        return None
    world = dist.get_world_size(group) if average else 1
    found, offset = {}, 0
    present = flat[-len(named) - 1 : -1]
    for i, (name, p) in enumerate(named):
        part = flat[offset : offset + p.numel()]
        offset += p.numel()
        if present[i] > 0:
            found[name] = (part / world).reshape(p.shape).to(p.dtype)
    return found


_RAISED_ELSEWHERE = "the loss calls collectives, and the check raised on another rank after them: no check made"


def _refused(step: int, text: str, code: NoteCode = NoteCode.LOSS_COLLECTIVES) -> CheckReport:
    """The ``inconclusive`` report of a check not made, saying why."""
    return CheckReport(step=step, verdict=Verdict.INCONCLUSIVE, probes=[], loss=math.nan, n_forward=0, n_backward=0,
                       duration_s=0.0, notes=[Note(code, text)])  # fmt: skip


def _together(model: nn.Module, batch: Any, loss_fn: LossFn, group: Any, split: bool, **check: Any) -> CheckReport:
    """This step's gradient recomputed on every rank (averaged as DDP averages it, or each rank's own part's where the
    model is ``split`` by hand) against the ranks' losses, every rank evaluating them together at the same points
    (:func:`~gradwatch.check_applied_gradient` with ``group``), without a culprit search (it would differentiate a
    rank's own loss); of ``check``, :func:`~gradwatch.check_gradients`'s keyword arguments, the step, the optimizers and
    the probe options apply."""
    from gradwatch.engine.applied.check import check_applied_gradient  # here: it imports check_gradients, decorated

    step = int(check.get("step", 0))
    drawn = capture_rng()  # the random numbers the gradient's forward draws, replayed by every evaluation
    gradients = _mean_gradient(model, batch, loss_fn, group, average=not split)
    if gradients is None:
        return _refused(step, _RAISED_ELSEWHERE)
    options = {k: v for k, v in check.items() if k not in ("focus", "rotation", "search_budget", "step")}
    token = _TOGETHER.set(True)
    try:
        report = check_applied_gradient(model, [batch], loss_fn, gradients, group=group, step=step, rng_states=[drawn],
                                        compare_one_batch=False, culprit_search=False, **options)  # fmt: skip
    finally:
        _TOGETHER.reset(token)
    return dataclasses.replace(report, scope="recomputed")


def split_check(model: nn.Module, batch: Any, loss_fn: LossFn, *, group: Any, **check: Any) -> CheckReport:
    """The recomputed check of a model split across the ranks by hand (:mod:`gradwatch.engine.applied.split`): each
    rank's own part's gradient against the sum of the ranks' losses, as the applied check of such a model does."""
    return _together(model, batch, loss_fn, group, True, **check)


def global_check(model: nn.Module, batch: Any, loss_fn: LossFn, *, group: Any, issued: int,
                 **check: Any) -> CheckReport:  # fmt: skip
    """The recomputed check of a loss with collectives inside, as the global loss every rank evaluates together (a
    model split by hand: as :func:`split_check` checks it)."""
    from gradwatch.engine.applied.window import ranks_with_other_parameters

    split = bool(ranks_with_other_parameters([(n, p) for n, p in model.named_parameters() if p.requires_grad], group))
    report = _together(model, batch, loss_fn, group, split, **check)
    how = "each rank's own part's, against the sum" if split else "averaged as DDP averages it, against the mean"
    text = (
        f"the loss calls collectives ({issued} in its first evaluation): a rank's own loss is not the function its "
        f"gradient differentiates, so this step's gradient, recomputed on every rank, {how} of the ranks' losses, "
        "was checked with every rank evaluating it together at the same points (the whole batch of each rank)"
    )
    return dataclasses.replace(report, notes=[Note(NoteCode.LOSS_COLLECTIVES, text), *report.notes])


def in_lockstep_for_collective_losses(check: Callable[Options, CheckReport]) -> Callable[Options, CheckReport]:
    """Make a recomputed check (``check(model, batch, loss_fn, ..., step=...)``) of replicas under a default process
    group of several ranks count its loss's collectives, and check a loss that runs any as the global loss
    (:func:`global_check`; see the module doc); every other check goes to ``check`` untouched."""
    signature = inspect.signature(check)

    @functools.wraps(check)
    def run(*args: Options.args, **kwargs: Options.kwargs) -> CheckReport:
        bound = signature.bind_partial(*args, **kwargs)
        model, batch, loss_fn = (bound.arguments.get(name) for name in ("model", "batch", "loss_fn"))
        group = counted_group(model) if isinstance(model, nn.Module) and callable(loss_fn) else None
        if group is None:
            return check(*args, **kwargs)
        if _TOGETHER.get():  # every rank alike: the same global check asks on each
            return _refused(
                int(bound.arguments.get("step", 0)), "no recomputed check inside a check of the global loss"
            )
        counter = CollectiveCounter(loss_fn, group)  # type: ignore[arg-type]  # callable, as asked above
        bound.arguments["loss_fn"] = counter
        report, error = None, None
        try:
            report = check(*bound.args, **bound.kwargs)
        except LossCollectivesError:
            pass
        except Exception as raised:
            error = raised
        if not counter.counted():  # no collective: the per-rank check as it ran (every rank's own, perhaps alone)
            if error is not None:
                raise error
            return report  # type: ignore[return-value]  # a check returns a report or raises
        # every rank ran the loss's collectives, so every rank is here: one reduction says whether all go on together
        state = torch.tensor([2 if error is not None else 1])
        dist.all_reduce(state, op=dist.ReduceOp.MAX, group=group)
        if error is not None:
            raise error
        if int(state) == 2:
            return _refused(int(bound.arguments.get("step", 0)), _RAISED_ELSEWHERE)
        return global_check(model, batch, loss_fn, group=group, issued=counter.issued, **bound.kwargs)  # type: ignore[arg-type]

    return run
