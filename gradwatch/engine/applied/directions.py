"""The directions of an applied check's probes, measured by the ladder: :class:`AppliedProbes`.

The probes move the parameters along the applied gradient (the descent probe), along every tensor's own normalised
gradient at once or over a group (the balanced probes, :mod:`.measured`), and along one tensor's part of it (which are
made: :mod:`.probes`). Each is a :class:`~gradwatch.engine.probing.tasks.ProbeTask` that the ladder measures and
escalates like a recomputed check's probe, from a two-point screen (natively once the descent's full stencil measured
the round-off) to a full stencil and a confirming one at ``0.3 h``, judged against the path's floor along the
direction (:class:`~.verdict.FloorJudge`). Steps follow :func:`~gradwatch.engine.numerics.steps.relative_step`, made
finer on float64 evaluations of a lower-precision gradient (:func:`~.verdict.float64_step`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from gradwatch.engine.applied.gradients import rank_means
from gradwatch.engine.applied.measured import Measured, balanced_weights, explained, floor_along
from gradwatch.engine.applied.path import AppliedPlan
from gradwatch.engine.applied.verdict import FloorJudge, Judged, float64_step, storage_rounding
from gradwatch.engine.applied.window_points import WindowMeasurements
from gradwatch.engine.distributed.collective import global_numel
from gradwatch.engine.function.evaluation import Reference
from gradwatch.engine.measuring.directions import VectorDirection
from gradwatch.engine.numerics.norms import norms
from gradwatch.engine.numerics.steps import machine_epsilon, relative_step
from gradwatch.engine.probing.ladder import Ladder
from gradwatch.engine.probing.portfolio import Portfolio, PortfolioTurn
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.results.kinds import PROBE_KINDS, ProbeKind, Reason
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import DESCENT_TARGET, Probe
from gradwatch.engine.settings import ProbeSettings


class AppliedProbes:
    """Measures the applied gradient along its own directions (see the module doc).

    Args:
        measurements: The window's measuring service.
        plan: The applied gradient and how it is judged.
        moved: The tensors the probes move (the parameters, or their float64 substitutes).
        floors: The path's noise floor per tensor (:func:`~.verdict.floors`).
        provisional: The floors are a lower bound (:mod:`.measurement`): a screen that does not agree stops there.
        rounding: Per tensor, ``e_T · g_T`` with ``e`` the measured rounding of the path's gradient (eager less
            float64), for :attr:`~.measured.Measured.explained`; ``None`` when not measured.
        slopes: :func:`balanced_slopes`, made before the float64 copy of the model (at whose peak their float64
            products would otherwise be made).
    """

    def __init__(self, measurements: WindowMeasurements, plan: AppliedPlan, moved: Sequence[Tensor],
                 floors: Sequence[float], *, provisional: bool = False, rounding: Sequence[float] | None = None,
                 slopes: dict[tuple[int, ...], tuple[float, float]] | None = None) -> None:  # fmt: skip
        self.measurements = measurements
        self.plan = plan
        native_dtype = plan.native
        self.rounding = rounding
        self.slopes = slopes or {}
        self.provisional = provisional
        self.names = list(plan.names)
        self.moved = list(moved)
        self.grads = list(plan.applied)
        self.floors = list(floors)
        self.multiple = plan.multiple
        self.native_dtype = plan.native
        judge = FloorJudge(measurements, plan.multiple, provisional=provisional)
        self.ladder = Ladder(
            measurements, judge=judge, native_dtype=native_dtype, reference_loss=measurements.reference
        )
        self.grad_norms = list(plan.applied_norms)
        self.grad_norm = math.hypot(*self.grad_norms)
        numels = [max(global_numel(t), 1) for t in self.moved]  # of the whole tensor, where ``t`` is a shard
        # every rank takes the same steps (ranks whose parameters diverged would average differences over other steps)
        param_norms = rank_means(norms(self.moved), getattr(measurements.evaluator, "group", None))
        self.param_rms = [n / math.sqrt(c) for n, c in zip(param_norms, numels, strict=True)]
        self.param_scale = math.hypot(*param_norms) / math.sqrt(sum(numels))
        self.relative = relative_step(measurements.compute_dtype, native_dtype)
        self.storage = storage_rounding(native_dtype)
        self.scale_floor = machine_epsilon(native_dtype) ** (1 / 3) * self.grad_norm
        compute_epsilon = machine_epsilon(measurements.compute_dtype)
        self.finer = math.isfinite(measurements.loss_noise) and compute_epsilon < machine_epsilon(native_dtype)

    def _scale(self, i: int) -> float:
        return max(self.param_rms[i], self.param_scale) or 1.0

    def step_along(self, step: float, tensors: Sequence[int], weights: Sequence[float]) -> float:
        """The step of a float64 probe along ``Σ_T w_T g_T`` (:func:`~.verdict.float64_step`; ``step`` natively), at
        the storage rounding alone, so that a second pass against the measured floor reuses the screens."""
        if not self.finer:
            return step
        least = self._least(tensors, weights)
        measurements = self.measurements
        rounding = measurements.loss_noise + measurements.assumed_epsilon * abs(measurements.reference)
        return float64_step(step, self.multiple * least, rounding)

    def _least(self, tensors: Sequence[int], weights: Sequence[float]) -> float:  # the storage rounding's floor
        return self.storage * math.fsum(w * self.grad_norms[i] ** 2 for i, w in zip(tensors, weights, strict=True))

    def descent(self) -> Measured | None:
        """The probe along ``ĝ`` (natively a full stencil, whose noise the screens borrow); ``None`` for a zero
        gradient."""
        if not self.grad_norm > 0 or not math.isfinite(self.grad_norm):
            return None
        every = tuple(range(len(self.moved)))
        weighted = sum(self._scale(i) ** 2 * (n / self.grad_norm) ** 2 for i, n in enumerate(self.grad_norms))
        direction = VectorDirection(self.moved, self.grads, self.grads, 1.0 / self.grad_norm,
                                    components_norm=self.grad_norm)  # fmt: skip
        task = ProbeTask(ProbeKind.DESCENT, DESCENT_TARGET, None, direction, self.relative * math.sqrt(weighted),
                         self.scale_floor, moves=every, floor=math.hypot(*self.floors))  # fmt: skip
        return self._measure(task, (1.0 / self.grad_norm,) * len(every))

    def balanced(self, group: Sequence[int] | None = None) -> Measured | None:
        """The probe along every tensor's own normalised gradient at once (:mod:`.measured`), or those of ``group``
        alone (its target then names them); ``None`` with fewer than two tensors with a gradient (the descent probe is
        that direction then)."""
        chosen = set(range(len(self.grad_norms)) if group is None else group)
        weights = balanced_weights([n if i in chosen else 0.0 for i, n in enumerate(self.grad_norms)])
        tensors = tuple(i for i, w in enumerate(weights) if w > 0)
        if len(tensors) < 2:
            return None
        target = DESCENT_TARGET if group is None else f"{self.names[tensors[0]]} and {len(tensors) - 1} more"
        direction = _balanced(
            [self.moved[i] for i in tensors],
            [self.grads[i] for i in tensors],
            [weights[i] for i in tensors],
            self.slopes.get(tensors),
        )
        part = 1.0 / math.sqrt(len(tensors))
        floor = floor_along([self.floors[i] for i in tensors], [part] * len(tensors))
        step = self.relative * math.sqrt(sum(self._scale(i) ** 2 for i in tensors) / len(tensors))
        task = ProbeTask(ProbeKind.TENSORS, target, None, direction, step, self.scale_floor, moves=tensors, floor=floor)
        return self._measure(task, tuple(weights[i] for i in tensors))

    def tensor(self, i: int) -> Measured | None:
        """The probe along tensor ``i``'s applied gradient; ``None`` when that is zero."""
        size = self.grad_norms[i]
        if not size > 0 or not math.isfinite(size):
            return None
        direction = VectorDirection([self.moved[i]], [self.grads[i]], [self.grads[i]], 1.0 / size,
                                    components_norm=size)  # fmt: skip
        task = ProbeTask(ProbeKind.TENSOR, self.names[i], None, direction, self.relative * self._scale(i),
                         self.scale_floor, moves=(i,), floor=self.floors[i])  # fmt: skip
        return self._measure(task, (1.0 / size,))

    def every_check(self) -> list[Measured | None]:
        """The probes of the kinds every check makes (:meth:`Portfolio.every_check
        <gradwatch.engine.probing.portfolio.Portfolio.every_check>`), each along the applied gradient in every tensor it
        moves, judged against those tensors' floors along it."""
        if not any(row.made_by for row in PROBE_KINDS.values()):
            return []
        reference = Reference(self.measurements.reference, list(self.grads), {})
        settings = PortfolioTurn(ProbeSettings(0, 0, 0, 0), step=0, rotation=0, focus=())
        portfolio = Portfolio(self.measurements.evaluator, reference, self.grad_norms, settings, self.native_dtype)
        found: list[Measured | None] = []
        for task in portfolio.every_check():
            direction = task.direction if task is not None else None
            along = isinstance(direction, VectorDirection) and all(
                c is g for c, g in zip(direction.components, direction.grads, strict=True)
            )
            if task is None or not isinstance(direction, VectorDirection) or not along:
                found.append(None)  # not along the applied gradient: no floor or attribution to judge it by
                continue
            tensors = tuple(i for i in task.moves if isinstance(i, int))
            weights = tuple(direction.coefficient * w for w in direction.weights or [1.0] * len(tensors))
            parts = [abs(w) * self.grad_norms[i] for i, w in zip(tensors, weights, strict=True)]
            task.floor, task.scale_floor = floor_along([self.floors[i] for i in tensors], parts), self.scale_floor
            found.append(self._measure(task, weights))
        return found

    def _measure(self, task: ProbeTask, weights: tuple[float, ...]) -> Measured:
        """``task`` up the ladder (``weights[k]``: its coefficient over the applied gradient in its ``k``-th tensor): a
        screen where a loss evaluation's round-off is known (else a full stencil), then, for a loss whose values are
        rounded coarser than the probes compute, a full stencil at the step of the values' dtype if needed."""
        step = task.step
        task.step = task.initial_step = self.step_along(step, [i for i in task.moves if isinstance(i, int)], weights)
        if math.isfinite(self.measurements.loss_noise):
            self.ladder.screen_and_escalate([task])
        else:
            self.ladder.measure_fully([task])
        assert task.result is not None
        if task.result.reason in (Reason.UNRESOLVED, Reason.FLAT) and self._coarse_values and not self.provisional:
            # (a float32 copy of a float64 loss): a step made for the computing dtype measures rounding noise
            self._say_coarse()
            first = (task.stencil, task.result, task.step)
            task.step, task.stencil = step * self.measurements.value_epsilon**0.2 / self.relative, None
            self.ladder.measure_fully([task])
            assert task.result is not None
            if task.result.reason in (Reason.UNRESOLVED, Reason.FLAT) and math.isfinite(task.result.noise):
                task.stencil, task.result, task.step = first
        return self._finish(task, weights)

    def _say_coarse(self) -> None:
        evaluator = self.measurements.evaluator
        if any(getattr(n, "code", None) == NoteCode.APPLIED_COARSE_LOSS for n in evaluator.notes):
            return
        dtype = str(evaluator.value_dtype).removeprefix("torch.")
        computed = str(self.measurements.compute_dtype).removeprefix("torch.")
        text = (
            f"the loss's value is delivered in {dtype} while the probes compute in {computed} (a {dtype} copy of the "
            f"loss on the way, such as torch.FloatTensor([cost])): probes the {computed} step could not resolve were "
            f"measured again at a step made for {dtype} values"
        )
        evaluator.notes.append(Note(NoteCode.APPLIED_COARSE_LOSS, text))

    @property
    def _coarse_values(self) -> bool:
        """Whether the loss delivers its values in a coarser dtype than the probes compute in."""
        return self.measurements.value_epsilon > machine_epsilon(self.measurements.compute_dtype)

    def _finish(self, task: ProbeTask, weights: tuple[float, ...]) -> Measured:
        result = task.result
        assert isinstance(result, Judged)
        analytic, numeric = task.direction.analytic, result.numeric
        rel_error = abs(numeric - analytic) / max(abs(numeric), abs(analytic), self.scale_floor)
        verdict: Any = result.verdict
        probe = Probe(kind=task.kind, target=task.target, index=None, analytic=analytic, numeric=numeric,
                      rel_error=rel_error, verdict=verdict, noise=result.noise, step=task.step,
                      reason=Reason(result.reason), evaluations=task.evaluations, floor=task.floor)  # fmt: skip
        tensors = tuple(i for i in task.moves if isinstance(i, int))
        least = self._least(tensors, weights)
        exact = result.tolerance - self.multiple * (task.floor - least) if self.rounding is not None else math.nan
        return Measured(probe, tensors, weights, result.tolerance, result.excess,
                        explained=explained(self.rounding, tensors, weights), exact_tolerance=exact)  # fmt: skip


def _balanced(
    moved: list[Tensor], grads: list[Tensor], scales: list[float], slopes: tuple[float, float] | None
) -> VectorDirection:
    """The direction of a balanced probe: components ``g_T · w_T``, made one at a time when used."""
    return VectorDirection(moved, grads, grads, scales=scales, slopes=slopes)


def balanced_slopes(plan: AppliedPlan, tensors: Sequence[Tensor]) -> dict[tuple[int, ...], tuple[float, float]]:
    """The slopes (:meth:`~gradwatch.engine.measuring.directions.VectorDirection.slopes`) of the balanced probe over
    every tensor of ``plan`` (``tensors``: those it moves, or tensors of the same sizes), by the tensors it moves."""
    weights = balanced_weights(list(plan.applied_norms))
    chosen = tuple(i for i, w in enumerate(weights) if w > 0)
    if len(chosen) < 2:
        return {}
    direction = _balanced(
        [tensors[i] for i in chosen], [plan.applied[i] for i in chosen], [weights[i] for i in chosen], None
    )
    return {chosen: direction.slopes()}
