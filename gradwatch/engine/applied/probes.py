"""The probes of an applied check: along the applied gradient itself, along every tensor's part of it at once, and
along each tensor's part of it when those two show an excess.

Two combined probes vouch for every tensor in four loss evaluations (besides the centre):

* the **descent** probe along ``ĝ`` over every tensor, which a fault scaling the whole gradient (accumulation, a loss
  scale) moves in full;
* the **tensors** probe along ``Σ_T ĝ_T / √N``, each tensor's own normalised gradient with equal weight, which a
  fault in one tensor moves by ``1/√N`` of that tensor's relative error, however small its share of ``‖g‖``
  (:mod:`.combined`).

Tensors they leave unvouched are probed in groups (:func:`~.combined.vouching_groups`), and the rest one by one along
their own ``ĝ_T``, in turn; so is every tensor when a combined probe does not agree well within its tolerance
(:data:`~.combined.CLOSER_LOOK`), and every one at once when one fails, so that the report names the tensors at fault.

Every probe starts as a two-point screen (with float64 evaluations, whose round-off is known: ``ε₆₄ · |L|``; natively,
the descent measures the noise of one loss evaluation with a full stencil first, which the others borrow), and climbs
to a full stencil, then to a confirming stencil at ``0.3 h``, only when its discrepancy exceeds the tolerance (the
escalation of :mod:`gradwatch.engine.probing.ladder`, judged against the path's floor by :mod:`.verdict`). Steps follow
:func:`~gradwatch.engine.numerics.steps.relative_step`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradwatch.engine.applied.combined import (
    balanced_components,
    balanced_weights,
    floor_along,
    tensors_to_probe,
    unvouched,
    vouching_groups,
)
from gradwatch.engine.applied.gradients import exact_conditions
from gradwatch.engine.applied.measured import Measured, Rounding, calm, explained, vouchers
from gradwatch.engine.applied.verdict import Judgement, confirmed, float64_step, judge, storage_rounding
from gradwatch.engine.distributed.collective import active as sharding_active
from gradwatch.engine.distributed.collective import global_numel
from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.function.precision import float64_storage, resolve_precision, substitute_of
from gradwatch.engine.measuring.directions import VectorDirection
from gradwatch.engine.measuring.points import Measurements
from gradwatch.engine.numerics.assessment import Assessment, assess, screen
from gradwatch.engine.numerics.norms import norms
from gradwatch.engine.numerics.stencil import HALF_OFFSETS, PAIR_OFFSETS, Stencil
from gradwatch.engine.numerics.steps import CONFIRMATION_STEP, center_tolerance, machine_epsilon, relative_step
from gradwatch.engine.results.kinds import ProbeKind, Reason
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import DESCENT_TARGET, CheckAbandonedError, Probe

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
    """

    def __init__(
        self,
        measurements: Measurements,
        names: Sequence[str],
        moved: Sequence[Tensor],
        grads: Sequence[Tensor],
        floors: Sequence[float],
        multiple: float,
        native_dtype: torch.dtype,
        provisional: bool = False,
        screens: dict[Any, Any] | None = None,
        rounding: Sequence[float] | None = None,
    ) -> None:
        self.measurements = measurements
        self.rounding = rounding
        self.provisional = provisional
        self.screens = screens if screens is not None else {}
        self.names = list(names)
        self.moved = list(moved)
        self.grads = list(grads)
        self.floors = list(floors)
        self.multiple = multiple
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
        self.loss_noise = (
            ROUNDING_ULPS * measurements.value_epsilon * abs(measurements.center)
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
        rounding = self.loss_noise + self.measurements.value_epsilon * abs(self.measurements.center)
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
        screen_first = math.isfinite(self.loss_noise)
        step = self.step_along(step, tensors, weights)
        evaluations = 0
        key = (kind, tensors, target, step, self.measurements.compute_dtype)
        if screen_first and key in self.screens:
            stencil = self.screens[key]
        else:
            stencil = self.measurements.stencil(direction, step, PAIR_OFFSETS if screen_first else FULL_OFFSETS)
            if screen_first:
                self.screens[key] = stencil
        evaluations += len(stencil.points)
        if screen_first:
            assessment = self._screen(stencil)
            judgement = judge(assessment, stencil, floor, self.multiple)
            if judgement.verdict == "ok" or self.provisional:
                return self._finish(kind, target, tensors, weights, stencil, assessment, judgement, floor, evaluations)
        if not stencil.full:
            stencil = stencil.extended(self.measurements.points(direction, step, HALF_OFFSETS))
            evaluations += 2
        assessment = self._assess(stencil)
        judgement = judge(assessment, stencil, floor, self.multiple)
        if kind == ProbeKind.DESCENT and stencil.finite and not math.isfinite(self.loss_noise):
            self.loss_noise = assessment.loss_noise
        if judgement.verdict == "fail":
            step *= CONFIRMATION_STEP
            second = self.measurements.stencil(direction, step, FULL_OFFSETS)
            evaluations += 4
            second_assessment = self._assess(second)
            second_judgement = judge(second_assessment, second, floor, self.multiple)
            if not confirmed(assessment, judgement, second_assessment, second_judgement):
                reason = "agrees" if second_judgement.verdict == "ok" else "unstable"
                verdict = "ok" if second_judgement.verdict == "ok" else "inconclusive"
                second_judgement = Judgement(verdict, reason, second_judgement.tolerance, second_judgement.excess)
            stencil, assessment, judgement = second, second_assessment, second_judgement
        return self._finish(kind, target, tensors, weights, stencil, assessment, judgement, floor, evaluations)

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


@dataclass(frozen=True)
class AppliedPlan:
    """What the probes of an applied check are asked to do: the gradient they measure and how they judge it.

    Attributes:
        names: The checked parameters' names.
        applied: The applied gradient, one tensor per checked parameter (this rank's rows of it when sharded).
        native: The parameters' dtype (the most precise of them).
        path_dtype: The precision of the training's path (its autocast dtype, else ``native``).
        multiple: How many noise floors of the path a gradient may be off.
        tensor_probes: Tensors probed along their own applied gradient per check, in turn, when the combined probes
            call for them (see :mod:`.combined`; every tensor once a probe fails).
        rotation: Which turn of tensors this check probes.
    """

    names: list[str]
    applied: list[Tensor]
    native: torch.dtype
    path_dtype: torch.dtype
    multiple: float
    tensor_probes: int
    rotation: int


def measure(
    evaluator: LossEvaluator,
    plan: AppliedPlan,
    floors: list[float],
    loss: float,
    screens: dict[Any, Any] | None = None,
    provisional: bool = False,
    rounding: Rounding | None = None,
) -> list[Measured]:
    """The probes of ``plan`` around the window's ``loss``, judged against the path's ``floors`` per tensor: on
    float64 storage where the model runs in float64 (else natively, float64 reductions).

    ``provisional``: the ``floors`` are a lower bound of the floor (:mod:`.lazy_floor`): the probes stop at the first
    screen that does not agree, or after the combined probes when one does not agree within
    :data:`~.combined.CLOSER_LOOK`. ``screens`` (a dict) collects the centre and the screens of one pass for another
    over the same point (with the measured floor), which evaluates them again only if they are not there.
    ``rounding``: per tensor, the measured rounding's part along its applied gradient (:class:`AppliedProbes`), which
    a closer look discounts (:mod:`.measured`)."""
    named = list(evaluator.params)
    elements = sum(p.numel() for _, p in named)
    args = (plan, floors, loss, screens, provisional, rounding)
    with exact_conditions():
        float64 = resolve_precision("auto", plan.native, elements) == "float64"
        if float64 and sharding_active() is not None:
            text = "float64 probes are not made on shards (FSDP gathers parameters in their own dtype)"
            evaluator.notes.append(Note(NoteCode.SHARDED_NATIVE, text))
        elif float64:
            try:
                with float64_storage(evaluator.model) as substitutes:
                    evaluator.params = [(n, substitute_of(p, substitutes)) for n, p in named]
                    evaluator.use_float64_inputs()
                    return _probes_at(evaluator, *args, torch.float64)
            except CheckAbandonedError:
                raise
            except Exception as error:  # no float64 kernel, a tensor made in float32 inside: probe natively
                text = f"probes run natively: the loss raised {type(error).__name__} in float64"
                evaluator.notes.append(Note(NoteCode.APPLIED_NATIVE, text))
            finally:
                evaluator.params = named
                evaluator.use_native_inputs()
        return _probes_at(evaluator, *args, plan.native)


def _probes_at(
    evaluator: LossEvaluator,
    plan: AppliedPlan,
    floors: list[float],
    loss: float,
    screens: dict[Any, Any] | None,
    provisional: bool,
    rounding: Rounding | None,
    compute: torch.dtype,
) -> list[Measured]:
    screens = screens if screens is not None else {}
    center = screens[compute] if compute in screens else evaluator.loss()
    screens[compute] = center
    if abs(center - loss) > center_tolerance(loss, plan.native, compute):
        evaluator.notes.append(
            Note(
                NoteCode.APPLIED_NOT_REPRODUCIBLE,
                f"no probe made: the window's loss is {center:.9g} when evaluated again, {loss:.9g} when "
                "differentiated; it draws randomness that was not recorded (pass rng_states) or is not a function "
                "of the parameters",
            )
        )
        return []
    measurements = Measurements(evaluator, center)
    beyond = rounding.beyond(norms(plan.applied, exact=True), floors, plan.multiple) if rounding else []
    discount = rounding.explained(beyond) if rounding else None  # (.measured)
    probes = AppliedProbes(measurements, plan.names, [p for _, p in evaluator.params], plan.applied, floors,
                           plan.multiple, plan.native, provisional, screens, discount)  # fmt: skip
    measured = [m for m in (probes.descent(), probes.balanced()) if m is not None]
    if provisional and not calm(measured):
        return measured
    if calm(measured):  # the tensors they leave unvouched, in groups a balanced probe over each would vouch for
        left = sorted(set(unvouched(vouchers(measured), probes.grad_norms, floors, plan.multiple)) - set(beyond))
        groups = [probes.balanced(g) for g in vouching_groups(left, probes.grad_norms, floors, plan.multiple)]
        measured += [m for m in groups if m is not None]
        if provisional and not calm(measured):
            return measured
    order = tensors_to_probe(vouchers(measured), probes.grad_norms, floors, plan.multiple, plan.tensor_probes,
                             plan.rotation, beyond)  # fmt: skip
    for i in order:
        found = probes.tensor(i)
        if found is not None:
            measured.append(found)
            if provisional and found.probe.verdict != "ok":
                return measured
    if any(m.probe.verdict == "fail" for m in measured) and len(order) < len(plan.names):
        for i in sorted(set(range(len(plan.names))) - set(order)):  # name every tensor at fault
            found = probes.tensor(i)
            if found is not None:
                measured.append(found)
    return measured


def _agreed(values: list[float], group: Any) -> list[float]:
    """``values`` averaged over the ranks of ``group`` (as they are without one): the probes' steps come from the
    parameters' sizes, and every rank must take the same step, or the ranks' losses, averaged at each point, would be
    differences over different steps (ranks whose parameters diverged after a step that applied different gradients)."""
    if group is None or not values:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(tensor, group=group)
    return (tensor / torch.distributed.get_world_size(group)).tolist()
