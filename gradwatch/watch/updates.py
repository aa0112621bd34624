"""The update checks of a :class:`~gradwatch.GradientWatch`: the update ``optimizer.step()`` makes of the gradient an
applied check verified, compared with a reference update (:mod:`gradwatch.engine.update`).

They run at the applied checks' steps, within the same budget (``check_update=False`` turns them off): when
:meth:`~gradwatch.GradientWatch.before_optimizer_step` verified a gradient, the watch keeps the values, the gradient and
the optimizer state of a few tensors and checks the update from a step post hook on the optimizer, so that a loop needs
no new line. The optimizer is the one ``before_optimizer_step`` was given (``optimizer=``, or of ``optimizers=``);
without one, torch's global step hooks catch the next step of any optimizer that updates the verified tensors; for a
DeepSpeed ZeRO engine, its torch optimizer (stepped once per param group, ZeRO-3 sub-group: checked after the last). A
loop whose optimizer runs no hooks calls :meth:`~gradwatch.GradientWatch.after_optimizer_step`. The hooks are one-shot,
removed at the watch's next call (removing a hook while torch runs the hooks would break a loop's own hooks after it).

The gradient the optimizer should step with is the verified one times the coefficient of the clip the loop declared
(``max_norm=`` or ``after_clipping``). Before a due step the watch keeps the previous step's gradient of the tensors it
will check, so that a step taken with a stale gradient is named.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from gradwatch.engine import CheckReport
from gradwatch.engine.distributed.whole import whole
from gradwatch.engine.distributed.zero import FullGradients
from gradwatch.engine.selection import checked_parameters
from gradwatch.engine.update import UpdateSnapshot, check_update, update_tensors
from gradwatch.engine.update.snapshot import innermost
from gradwatch.watch.cadence import Cadence
from gradwatch.watch.lessons import Lessons
from gradwatch.watch.outcomes import Outcomes
from gradwatch.watch.overhead import OverheadClock

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """An update check waiting for its optimizer's step."""

    step: int
    named: list[tuple[str, Tensor]]
    norm: float
    max_norm: float | None
    previous: dict[str, Tensor]
    grads: dict[str, Tensor] = field(default_factory=dict)  # the verified gradients, copied before the loop clips
    _: KW_ONLY
    snapshot: UpdateSnapshot | None = None
    last: Any = None  # the optimizer's last param group: ZeRO steps its torch optimizer once per group
    handles: list[RemovableHandle] = field(default_factory=list)
    done: bool = False


def _stepping(optimizer: Any, optimizers: Sequence[Any]) -> Any:
    """The optimizer about to step: the one named, else the loop's only one, else ``None`` (found by the hooks)."""
    return optimizers[0] if optimizer is None and len(optimizers) == 1 else optimizer


def zero_engine(gradients: Any) -> Any:
    """The DeepSpeed ZeRO engine whose :class:`FullGradients` ``gradients`` are, else ``None`` (its fp32 master
    parameters and optimizer state partitioned: :mod:`gradwatch.engine.distributed.whole` gathers the checked ones)."""
    engine = gradients.engine if isinstance(gradients, FullGradients) else None
    return engine if engine is not None and engine.zero_optimization_stage() in (1, 2, 3) else None


class UpdateChecks:
    """The update checks of a watch (see the module doc): within the applied checks' cadence and budget (the
    ``applied`` cadence's cost includes the update check each applied check leads to), since they are made of the
    gradients those checks verified; their reports go to ``outcomes``."""

    def __init__(self, outcomes: Outcomes, lessons: Lessons, clock: OverheadClock, applied: Cadence) -> None:
        self._outcomes, self._lessons, self._clock, self._applied = outcomes, lessons, clock, applied
        self.pending: _Pending | None = None
        self._previous: tuple[int, dict[str, Tensor]] | None = None
        self._declared: dict[int, float] = {}
        self._checks = 0

    def release(self, step: int | None = None) -> None:
        """Remove the hooks of a pending check that has run (or, ``step``: that belongs to an earlier step)."""
        pending = self.pending
        if pending is not None and (pending.done or (step is not None and pending.step < step)):
            for handle in pending.handles:
                handle.remove()
            self.pending = None

    def _candidates(
        self, model: nn.Module, optimizer: Any, updated: Sequence[tuple[str, nn.Parameter]] | None,
        gradients: Mapping[str, Tensor] | None = None,
    ) -> list[tuple[str, Tensor]]:  # fmt: skip
        named = list(updated) if updated is not None else list(model.named_parameters())
        names = {name for name, _ in checked_parameters(model, self._lessons.active.ignore)}
        named = [(name, p) for name, p in named if name in names]
        return update_tensors(optimizer, named, rotation=self._checks, graded=gradients)

    def keep_previous(
        self, model: nn.Module, step: int, optimizer: Any, optimizers: Sequence[Any],
        updated: Sequence[tuple[str, nn.Parameter]] | None,
    ) -> None:  # fmt: skip
        """Before a step due for an applied check, keep this step's gradient of the tensors that check will compare."""
        optimizer = _stepping(optimizer, optimizers)
        with torch.no_grad():
            candidates = self._candidates(model, optimizer, updated)
            grads = {n: whole(p.grad).detach().clone() for n, p in candidates if p.grad is not None}
        self._previous = (step, grads)

    def prepare(
        self,
        model: nn.Module,
        step: int,
        optimizer: Any,
        optimizers: Sequence[Any],
        updated: Sequence[tuple[str, nn.Parameter]] | None,
        *,
        norm: float,
        max_norm: float | None,
        engine: Any = None,
        gradients: Mapping[str, Tensor] | None = None,
    ) -> None:
        """An applied check verified step ``step``'s gradient: keep what the update check needs and hook the step
        (``engine``: a ZeRO engine, whose ZeRO optimizer steps, and clips by its ``gradient_clipping``, the whole
        verified ``gradients`` it keeps in its partitions)."""
        self.release(step + 1)
        optimizer = _stepping(optimizer, optimizers)
        if engine is not None:
            optimizer, max_norm = engine.optimizer, max_norm or engine.gradient_clipping() or None
        else:
            gradients = None
        previous = self._previous[1] if self._previous and self._previous[0] == step - 1 else {}
        self._previous = None  # not held longer than it is needed (a GPU's memory)
        named = self._candidates(model, optimizer if gradients is None else None, updated, gradients)
        if not named:
            return
        with torch.no_grad():  # copied now: the loop clips .grad in place before the step
            grads = (
                {name: whole(p.grad).detach().clone() for name, p in named if p.grad is not None}
                if gradients is None
                else {name: gradients[name].detach().clone() for name, _ in named}
            )
        pending = _Pending(step, named, norm, max_norm if max_norm is not None else self._declared.get(step),
                           previous, grads)  # fmt: skip
        self.pending = pending
        if optimizer is not None:
            inner = innermost(optimizer)
            # ZeRO-3 steps each sub-group's flat partition in its param group's (else empty) params
            flats = getattr(optimizer, "fp32_partitioned_groups_flat", None)
            pending.last = flats[-1] if flats else inner.param_groups[-1]
            pending.snapshot = self._snapshot(pending, optimizer)
            pending.handles.append(inner.register_step_post_hook(self._hook(pending)))
            return

        def before(stepping: Any, *_: Any) -> None:  # the first optimizer that updates a kept tensor
            with self._outcomes.guard("the update check's step pre-hook"):
                _keep(stepping)

        def _keep(stepping: Any) -> None:
            if pending.snapshot is None and not pending.done:
                ids = {id(p) for group in stepping.param_groups for p in group["params"]}
                mine = [(n, p) for n, p in pending.named if id(p) in ids]
                if mine:
                    pending.named = mine
                    pending.snapshot = self._snapshot(pending, stepping)

        after = self._hook(pending)
        pending.handles += [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]

    def _snapshot(self, pending: _Pending, optimizer: Any) -> UpdateSnapshot:
        return UpdateSnapshot.take(optimizer, pending.named, norm=pending.norm, max_norm=pending.max_norm,
                                   previous=pending.previous, grads=pending.grads)  # fmt: skip

    def _hook(self, pending: _Pending) -> Callable[..., None]:
        def after(stepping: Any, *_: Any) -> None:
            snapshot, groups = pending.snapshot, stepping.param_groups
            if (not pending.done and snapshot is not None and innermost(stepping) is snapshot.optimizer
                    and (pending.last is None or groups[-1] is pending.last
                         or any(p is pending.last for g in groups for p in g["params"]))):  # fmt: skip
                with self._outcomes.guard("the update check's step post-hook"):  # never ends the optimizer's step
                    self._run(pending)

        return after

    def _run(self, pending: _Pending) -> CheckReport | None:
        pending.done = True
        snapshot = pending.snapshot
        if snapshot is None:
            return None
        snapshot = snapshot.with_clip(self._declared.get(pending.step) if snapshot.max_norm is None else None)
        # a ZeRO parameter's .grad is not what its optimizer steps with (the partitions are)
        zero = [k for k in snapshot.kept if hasattr(k.param, "_hp_mapping") or hasattr(k.param, "ds_id")]
        given = {k.name: None if k in zero else whole(k.param.grad) for k in snapshot.kept}
        started = time.perf_counter()
        report = self._outcomes.guarded(pending.step, lambda: check_update(snapshot, step=pending.step, given=given),
                                        [])  # fmt: skip
        seconds = time.perf_counter() - started
        first = self._checks == 0 and self._applied.checks <= 1  # the update of the run's first applied check
        self._clock.add_check(seconds, first=first)  # gradwatch's time, within the applied checks' budget
        self._applied.cost += seconds
        self._checks += 1
        pending.snapshot, pending.grads = None, {}  # the copies are needed no more
        if report is not None:
            self._outcomes.publish(report, self._clock.fraction)
        return report

    def stepped(self, optimizer: Any, step: int) -> CheckReport | None:
        """``optimizer`` (``None``: the one kept) stepped at ``step``: the report of its update check (run now when its
        step ran no hooks), else ``None`` (see :meth:`~gradwatch.GradientWatch.after_optimizer_step`)."""
        pending = self.pending
        if pending is None or pending.step != step:
            return None
        if pending.done:
            report = next((r for r in reversed(self._outcomes.reports) if r.scope == "update"), None)
            self.release()
            return report if report is not None and report.step == step else None
        snapshot = pending.snapshot
        if snapshot is None or (optimizer is not None and innermost(optimizer) is not snapshot.optimizer):
            return None
        report = self._run(pending)
        self.release()
        return report

    def declare(self, step: int, max_norm: float) -> None:
        """The loop clips step ``step``'s gradient to ``max_norm`` (``after_clipping``): the update check's gradient."""
        self._declared = {step: float(max_norm)}
