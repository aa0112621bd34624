"""Each probe of an applied check as stencils: :class:`AppliedProbes` (the directions are :mod:`.probes`').

Every probe starts as a two-point screen (with float64 evaluations, whose round-off is known: ``ε₆₄ · |L|``; natively,
the descent measures the noise of one loss evaluation with a full stencil first, which the others borrow), and climbs
to a full stencil, then to a confirming stencil at ``0.3 h``, only when its discrepancy exceeds the tolerance (the
escalation of :mod:`gradwatch.engine.probing.ladder`, judged against the path's floor by :mod:`.verdict`). Steps follow
:func:`~gradwatch.engine.numerics.steps.relative_step`.

A float64 check evaluates no loss at the unperturbed point up front: a screen's central difference does not use it
(the centre cancels out of ``(φ(h) − φ(−h)) / 2h``), and the first screen's mean ``(φ(h) + φ(−h)) / 2 = φ(0) + O(h²)``
stands in for it where it is used: the window's reproducibility (against the differentiated loss within
:func:`~gradwatch.engine.numerics.steps.center_tolerance`, a hundred times wider than the ``h²`` term at these steps)
and a screen's rounding quantum. The loss at the centre itself is evaluated only when a stencil needs it: a full
stencil (its fourth difference), a screen whose two points are equal (flat or not), or a pair mean beyond that
tolerance (the centre then decides, as it always did).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradwatch.engine.applied.combined import balanced_components, balanced_weights, floor_along
from gradwatch.engine.applied.measured import Measured, explained
from gradwatch.engine.applied.plan import AppliedPlan
from gradwatch.engine.applied.verdict import Judgement, confirmed, float64_step, judge, storage_rounding
from gradwatch.engine.distributed.collective import global_numel
from gradwatch.engine.measuring.directions import VectorDirection
from gradwatch.engine.measuring.points import Measurements
from gradwatch.engine.numerics.assessment import Assessment, assess, screen
from gradwatch.engine.numerics.kinks import at_a_tie
from gradwatch.engine.numerics.norms import norms
from gradwatch.engine.numerics.stencil import HALF_OFFSETS, PAIR_OFFSETS, Stencil
from gradwatch.engine.numerics.steps import CONFIRMATION_STEP, center_tolerance, machine_epsilon, relative_step
from gradwatch.engine.results.kinds import ProbeKind, Reason
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import DESCENT_TARGET, Probe

FULL_OFFSETS = PAIR_OFFSETS + HALF_OFFSETS

ROUNDING_ULPS = 8.0
"""The round-off of one float64 loss evaluation, in units of its last place: the noise a screen assumes before any
full stencil has measured it (float64 round-off lies orders of magnitude below every tolerance of a float32 or 16-bit
gradient, so the figure only needs to be generous)."""


class AppliedProbes:
    """Measures the applied gradient ``grads`` along its own directions (see the module doc).

    Args:
        measurements: The measuring service around the unperturbed window loss.
        names: The checked parameters' names.
        moved: The tensors the probes move (the parameters, or their float64 substitutes).
        grads: The applied gradient, one tensor per parameter.
        floors: The path's noise floor per tensor (see :func:`~gradwatch.engine.applied.verdict.floors`).
        multiple: How many floors a gradient may be off.
        native_dtype: The parameters' dtype.
        provisional: The floors are a lower bound (:mod:`.lazy_floor`): a screen that does not agree stops there, for
            the check to measure the floor and probe again.
        screens: The screens of an earlier pass over the same point, by probe (filled in for a later one): probing
            again against another floor evaluates nothing twice.
        rounding: Per tensor, ``e_T · g_T`` with ``e`` the measured rounding of the path's gradient (eager less
            float64, :mod:`.lazy_floor`), for :attr:`~.measured.Measured.explained`; ``None`` when not measured.
        reference: The window's loss as it was differentiated: the magnitude the float64 round-off assumes (the same
            in every pass, so that a second pass takes the same steps), and what the centre must reproduce.
        pending: ``measurements.center`` is not the loss at the centre yet (see the module doc): the first screen's
            mean stands in for it, and a stencil that needs it evaluates it.
    """

    def __init__(
        self,
        measurements: Measurements,
        plan: AppliedPlan,
        moved: Sequence[Tensor],
        floors: Sequence[float],
        *,
        provisional: bool = False,
        screens: dict[Any, Any] | None = None,
        rounding: Sequence[float] | None = None,
        reference: float | None = None,
        pending: bool = False,
    ) -> None:
        self.measurements = measurements
        self.reference = measurements.center if reference is None else reference
        self.pending = pending
        native_dtype = self.native_dtype = plan.native
        self.rounding = rounding
        self.provisional = provisional
        self.screens = screens if screens is not None else {}
        self.names = list(plan.names)
        self.moved = list(moved)
        self.grads = list(plan.applied)
        self.floors = list(floors)
        self.multiple = plan.multiple
        self.grad_norms = norms(self.grads, exact=True)
        self.grad_norm = math.hypot(*self.grad_norms)
        numels = [max(global_numel(t), 1) for t in self.moved]  # of the whole tensor, where ``t`` is a shard
        param_norms = _agreed(norms(self.moved), getattr(measurements.evaluator, "group", None))
        self.param_rms = [n / math.sqrt(c) for n, c in zip(param_norms, numels, strict=True)]
        self.param_scale = math.hypot(*param_norms) / math.sqrt(sum(numels))
        self.relative = relative_step(measurements.compute_dtype, native_dtype)
        self.storage = storage_rounding(native_dtype)
        self.scale_floor = machine_epsilon(native_dtype) ** (1 / 3) * self.grad_norm
        # float64 evaluations: the round-off of one is known well enough for a screen; natively the descent measures it
        # (before any evaluation on float64 storage, its values are taken to be float64: :meth:`_centred` checks)
        unknown = pending and "pair" not in self.screens
        self.value_epsilon = machine_epsilon(torch.float64) if unknown else measurements.value_epsilon
        self.loss_noise = (
            ROUNDING_ULPS * self.value_epsilon * abs(self.reference)
            if measurements.compute_dtype == torch.float64
            else math.inf
        )
        compute_epsilon = machine_epsilon(measurements.compute_dtype)
        self.finer = math.isfinite(self.loss_noise) and compute_epsilon < machine_epsilon(native_dtype)

    def _scale(self, i: int) -> float:
        return max(self.param_rms[i], self.param_scale) or 1.0

    def step_along(self, step: float, tensors: Sequence[int], weights: Sequence[float]) -> float:
        """The step of a float64 probe along ``Σ_T w_T g_T`` (:func:`~.verdict.float64_step`; ``step`` natively), of the
        storage rounding alone: a second pass against the measured floor reuses the screens."""
        if not self.finer:
            return step
        least = self._least(tensors, weights)
        rounding = self.loss_noise + self.value_epsilon * abs(self.reference)
        return float64_step(step, self.multiple * least, rounding)

    def _least(self, tensors: Sequence[int], weights: Sequence[float]) -> float:  # the storage rounding's floor
        return self.storage * math.fsum(w * self.grad_norms[i] ** 2 for i, w in zip(tensors, weights, strict=True))

    def descent(self) -> Measured | None:
        """The probe along ``ĝ`` (a full stencil), whose noise the screens borrow; ``None`` for a zero gradient."""
        if not self.grad_norm > 0 or not math.isfinite(self.grad_norm):
            return None
        every = tuple(range(len(self.moved)))
        weighted = sum(self._scale(i) ** 2 * (n / self.grad_norm) ** 2 for i, n in enumerate(self.grad_norms))
        direction = VectorDirection(self.moved, self.grads, self.grads, 1.0 / self.grad_norm,
                                    components_norm=self.grad_norm)  # fmt: skip
        floor = math.hypot(*self.floors)
        weights = (1.0 / self.grad_norm,) * len(every)
        return self._measure(ProbeKind.DESCENT, DESCENT_TARGET, every, weights, direction, floor,
                             self.relative * math.sqrt(weighted))  # fmt: skip

    def balanced(self, group: Sequence[int] | None = None) -> Measured | None:
        """The probe along every tensor's own normalised gradient at once (:mod:`.combined`), or those of ``group``
        alone (its target then names them); ``None`` with fewer than two tensors with a gradient (the descent probe is
        that direction then)."""
        chosen = set(range(len(self.grad_norms)) if group is None else group)
        weights = balanced_weights([n if i in chosen else 0.0 for i, n in enumerate(self.grad_norms)])
        tensors = tuple(i for i, w in enumerate(weights) if w > 0)
        if len(tensors) < 2:
            return None
        target = DESCENT_TARGET if group is None else f"{self.names[tensors[0]]} and {len(tensors) - 1} more"
        components = balanced_components([self.grads[i] for i in tensors], [weights[i] for i in tensors])
        direction = VectorDirection([self.moved[i] for i in tensors], components, [self.grads[i] for i in tensors])
        part = 1.0 / math.sqrt(len(tensors))
        floor = floor_along([self.floors[i] for i in tensors], [part] * len(tensors))
        step = self.relative * math.sqrt(sum(self._scale(i) ** 2 for i in tensors) / len(tensors))
        return self._measure(ProbeKind.TENSORS, target, tensors, tuple(weights[i] for i in tensors),
                             direction, floor, step)  # fmt: skip

    def tensor(self, i: int) -> Measured | None:
        """The probe along tensor ``i``'s applied gradient; ``None`` when that is zero."""
        size = self.grad_norms[i]
        if not size > 0 or not math.isfinite(size):
            return None
        direction = VectorDirection([self.moved[i]], [self.grads[i]], [self.grads[i]], 1.0 / size,
                                    components_norm=size)  # fmt: skip
        return self._measure(ProbeKind.TENSOR, self.names[i], (i,), (1.0 / size,), direction, self.floors[i],
                             self.relative * self._scale(i))  # fmt: skip

    def _measure(
        self,
        kind: ProbeKind,
        target: str,
        tensors: tuple[int, ...],
        weights: tuple[float, ...],
        direction: VectorDirection,
        floor: float,
        step: float,
    ) -> Measured:
        base = step
        step = self.step_along(step, tensors, weights)
        stencil, assessment, judgement, evaluations = self._stencils(kind, target, tensors, direction, floor, step)
        if judgement.reason in (Reason.UNRESOLVED, Reason.FLAT) and self._coarse_values and not self.provisional:
            # the loss's values are rounded coarser than the probes compute (a float32 copy of a float64 loss): a step
            # made for the computing dtype leaves a difference of rounding noise; the step of the values' dtype
            # resolves the slope
            coarse = base * self.measurements.value_epsilon**0.2 / self.relative
            self._say_coarse()
            found = self._full(direction, floor, coarse, kind)
            evaluations += found[3]
            if found[2].reason not in (Reason.UNRESOLVED, Reason.FLAT) or not math.isfinite(found[1].noise):
                stencil, assessment, judgement = found[:3]
        return self._finish(kind, target, tensors, weights, stencil, assessment, judgement, floor, evaluations)

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

    def _stencils(
        self,
        kind: ProbeKind,
        target: str,
        tensors: tuple[int, ...],
        direction: VectorDirection,
        floor: float,
        step: float,
    ) -> tuple[Stencil, Assessment, Judgement, int]:
        """A probe's screen, then its full stencil and confirmation where the screen does not agree."""
        screen_first = math.isfinite(self.loss_noise)
        key = (kind, tensors, target, step, self.measurements.compute_dtype)
        if screen_first and key in self.screens:
            stencil = self.screens[key]
        else:
            stencil = self.measurements.stencil(direction, step, PAIR_OFFSETS if screen_first else FULL_OFFSETS)
            if screen_first:
                stencil = self._centred(stencil)
                self.screens[key] = stencil
        evaluations = len(stencil.points)
        if screen_first:
            assessment = self._screen(stencil)
            judgement = judge(assessment, stencil, floor, self.multiple)
            if judgement.verdict == "ok" or self.provisional:
                return stencil, assessment, judgement, evaluations
        if not stencil.full:
            stencil = self._exact(stencil).extended(self.measurements.points(direction, step, HALF_OFFSETS))
            evaluations += 2
        found = self._judged(stencil, floor, step, direction, kind)
        return found[0], found[1], found[2], evaluations + found[3]

    def _full(
        self, direction: VectorDirection, floor: float, step: float, kind: ProbeKind
    ) -> tuple[Stencil, Assessment, Judgement, int]:
        """A full stencil at ``step`` (around the centre), judged and confirmed."""
        stencil = self._exact(self.measurements.stencil(direction, step, FULL_OFFSETS))
        found = self._judged(stencil, floor, step, direction, kind)
        return found[0], found[1], found[2], len(FULL_OFFSETS) + found[3]

    def _judged(
        self, stencil: Stencil, floor: float, step: float, direction: VectorDirection, kind: ProbeKind
    ) -> tuple[Stencil, Assessment, Judgement, int]:
        """A full stencil's judgement; a failure confirmed at a second, smaller step (which then stands)."""
        assessment = self._assess(stencil)
        judgement = judge(assessment, stencil, floor, self.multiple)
        if kind == ProbeKind.DESCENT and stencil.finite and not math.isfinite(self.loss_noise):
            self.loss_noise = assessment.loss_noise
        if judgement.verdict != "fail":
            return stencil, assessment, judgement, 0
        second = self.measurements.stencil(direction, step * CONFIRMATION_STEP, FULL_OFFSETS)
        second_assessment = self._assess(second)
        second_judgement = judge(second_assessment, second, floor, self.multiple)
        if not confirmed(assessment, judgement, second_assessment, second_judgement):
            reason = "agrees" if second_judgement.verdict == "ok" else "unstable"
            verdict = "ok" if second_judgement.verdict == "ok" else "inconclusive"
            second_judgement = Judgement(verdict, reason, second_judgement.tolerance, second_judgement.excess)
        elif at_a_tie(stencil, self.measurements.value_epsilon) or at_a_tie(second, self.measurements.value_epsilon):
            # a kink at the point (a ReLU input or a max-pool window exactly tied): the loss has no derivative
            # along the probe, the central difference is the mean of its one-sided slopes at any step (so the
            # discrepancy reproduces) and autograd's choice of one side is no wrong formula
            second_judgement = Judgement("inconclusive", "tie", second_judgement.tolerance, second_judgement.excess)
        return second, second_assessment, second_judgement, 4

    def _centred(self, screen: Stencil) -> Stencil:
        """``screen`` around the centre as far as it is known: the first screen's mean stands in for the loss at the
        centre while that is pending, or the loss there where the mean is not close enough to the differentiated
        loss, or where the two points are equal (a flat screen is told by the centre)."""
        if not self.pending:
            return screen
        if "pair" not in self.screens:
            values = [p.value for p in screen.points]
            mean = math.fsum(values) / len(values)
            self.screens["pair"] = mean
            if self.measurements.value_epsilon != self.value_epsilon:  # the loss rounds its value to a coarser dtype
                self.value_epsilon = self.measurements.value_epsilon
                self.loss_noise = ROUNDING_ULPS * self.value_epsilon * abs(self.reference)
                return self._exact(screen)
            if not math.isfinite(mean) or not self._reproduces(mean) or values[0] == values[1]:
                return self._exact(screen)
            self.measurements.center = mean
        elif screen.points[0].value == screen.points[1].value:
            return self._exact(screen)
        return Stencil(screen.step, self.measurements.center, screen.analytic, screen.points)

    def _exact(self, stencil: Stencil) -> Stencil:
        """``stencil`` around the loss at the centre, evaluated now if it is pending (raising
        :class:`NotReproducibleError` where it does not reproduce the differentiated loss)."""
        if self.pending:
            center = self.measurements.evaluator.loss()
            self.screens[self.measurements.compute_dtype] = center
            self.pending = False
            self.measurements.center = center
            if not self._reproduces(center):
                raise NotReproducibleError(center)
        return Stencil(stencil.step, self.measurements.center, stencil.analytic, stencil.points)

    def _reproduces(self, center: float) -> bool:
        tolerance = center_tolerance(self.reference, self.native_dtype, self.measurements.compute_dtype)
        return not abs(center - self.reference) > tolerance

    def _screen(self, stencil: Stencil) -> Assessment:
        return screen(
            stencil,
            rtol=0.0,
            scale_floor=self.scale_floor,
            value_epsilon=self.measurements.value_epsilon,
            loss_noise=self.loss_noise,
        )

    def _assess(self, stencil: Stencil) -> Assessment:
        return assess(stencil, rtol=0.0, scale_floor=self.scale_floor, value_epsilon=self.measurements.value_epsilon)

    def _finish(
        self,
        kind: ProbeKind,
        target: str,
        tensors: tuple[int, ...],
        weights: tuple[float, ...],
        stencil: Stencil,
        assessment: Assessment,
        judgement: Judgement,
        floor: float,
        evaluations: int,
    ) -> Measured:
        numeric = assessment.numeric
        probe = Probe(
            kind=kind,
            target=target,
            index=None,
            analytic=stencil.analytic,
            numeric=numeric,
            rel_error=abs(numeric - stencil.analytic) / max(abs(numeric), abs(stencil.analytic), self.scale_floor),
            verdict=judgement.verdict,  # type: ignore[arg-type]
            noise=assessment.noise,
            step=stencil.step,
            reason=Reason(judgement.reason),
            evaluations=evaluations,
            floor=floor,
        )
        least = self._least(tensors, weights)
        exact = judgement.tolerance - self.multiple * (floor - least) if self.rounding is not None else math.nan
        return Measured(probe, tensors, weights, judgement.tolerance, judgement.excess,
                        explained(self.rounding, tensors, weights), exact)  # fmt: skip


class NotReproducibleError(Exception):
    """The loss at the centre, evaluated again, is not the differentiated loss (:func:`measure` says so and probes
    nothing)."""

    def __init__(self, center: float) -> None:
        super().__init__(center)
        self.center = center


def _agreed(values: list[float], group: Any) -> list[float]:
    """``values`` averaged over the ranks of ``group`` (as they are without one): the probes' steps come from the
    parameters' sizes, and every rank must take the same step, or the ranks' losses, averaged at each point, would be
    differences over different steps (ranks whose parameters diverged after a step that applied different gradients)."""
    if group is None or not values:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(tensor, group=group)
    return (tensor / torch.distributed.get_world_size(group)).tolist()
