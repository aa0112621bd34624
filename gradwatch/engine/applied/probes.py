"""The probes of an applied check: along the applied gradient itself, and along each tensor's part of it.

The descent probe (``ĝ`` over every tensor, a full stencil) measures the noise of one loss evaluation; each tensor probe
starts as a two-point screen that borrows it, and climbs to a full stencil, then to a confirming stencil at ``0.3 h``,
only when its discrepancy exceeds the tolerance (the escalation of :mod:`gradwatch.engine.probing.ladder`, judged
against the path's floor by :mod:`.verdict`). Steps follow :func:`~gradwatch.engine.numerics.steps.relative_step`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradwatch.engine.applied.gradients import exact_conditions
from gradwatch.engine.applied.verdict import Judgement, confirmed, judge
from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.function.precision import float64_storage, resolve_precision
from gradwatch.engine.kinds import ProbeKind, Reason
from gradwatch.engine.measuring.directions import VectorDirection
from gradwatch.engine.measuring.points import Measurements
from gradwatch.engine.notes import Note, NoteCode
from gradwatch.engine.numerics.assessment import Assessment, assess, screen
from gradwatch.engine.numerics.norms import dot, norms, total
from gradwatch.engine.numerics.stencil import HALF_OFFSETS, PAIR_OFFSETS, Stencil
from gradwatch.engine.numerics.steps import CONFIRMATION_STEP, center_tolerance, machine_epsilon, relative_step
from gradwatch.engine.report import DESCENT_TARGET, CheckAbandonedError, Probe
from gradwatch.engine.sharding.collective import active as sharding_active
from gradwatch.engine.sharding.collective import global_numel

FULL_OFFSETS = PAIR_OFFSETS + HALF_OFFSETS


@dataclass
class Measured:
    """A finished probe and what an attribution needs of it: which tensors it moved, its unit direction's coefficient
    over the applied gradient there, the derivative it measured and its tolerance."""

    probe: Probe
    tensors: tuple[int, ...]
    coefficient: float
    tolerance: float
    excess: float

    def agrees(self, grads: Sequence[Tensor], applied: Sequence[Tensor]) -> bool:
        """Whether another gradient ``grads`` agrees with the measured derivative along this probe's direction."""
        slope = self.coefficient * total([dot(grads[i], applied[i]) for i in self.tensors])
        return math.isfinite(slope) and abs(slope - self.probe.numeric) <= self.tolerance


@dataclass(frozen=True)
class _Along:
    """What a probe moves: its kind and target, the tensors, the norm of the applied gradient over them and the
    path's floor there."""

    kind: ProbeKind
    target: str
    tensors: tuple[int, ...]
    size: float
    floor: float


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
    ) -> None:
        self.measurements = measurements
        self.names = list(names)
        self.moved = list(moved)
        self.grads = list(grads)
        self.floors = list(floors)
        self.multiple = multiple
        self.grad_norms = norms(self.grads, exact=True)
        self.grad_norm = math.hypot(*self.grad_norms)
        numels = [max(global_numel(t), 1) for t in self.moved]  # of the whole tensor, where ``t`` is a shard
        param_norms = norms(self.moved)
        self.param_rms = [n / math.sqrt(c) for n, c in zip(param_norms, numels, strict=True)]
        self.param_scale = math.hypot(*param_norms) / math.sqrt(sum(numels))
        self.relative = relative_step(measurements.compute_dtype, native_dtype)
        self.scale_floor = machine_epsilon(native_dtype) ** (1 / 3) * self.grad_norm
        self.loss_noise = math.inf

    def _scale(self, i: int) -> float:
        return max(self.param_rms[i], self.param_scale) or 1.0

    def descent(self) -> Measured | None:
        """The probe along ``ĝ`` (a full stencil), whose noise the screens borrow; ``None`` for a zero gradient."""
        if not self.grad_norm > 0 or not math.isfinite(self.grad_norm):
            return None
        every = tuple(range(len(self.moved)))
        weighted = sum(self._scale(i) ** 2 * (n / self.grad_norm) ** 2 for i, n in enumerate(self.grad_norms))
        return self._measure(
            ProbeKind.DESCENT, DESCENT_TARGET, every, self.relative * math.sqrt(weighted), screen_first=False
        )

    def tensor(self, i: int) -> Measured | None:
        """The probe along tensor ``i``'s applied gradient; ``None`` when that is zero."""
        if not self.grad_norms[i] > 0 or not math.isfinite(self.grad_norms[i]):
            return None
        return self._measure(ProbeKind.TENSOR, self.names[i], (i,), self.relative * self._scale(i), screen_first=True)

    def _measure(
        self, kind: ProbeKind, target: str, tensors: tuple[int, ...], step: float, *, screen_first: bool
    ) -> Measured:
        size = math.hypot(*(self.grad_norms[i] for i in tensors))
        floor = math.hypot(*(self.floors[i] for i in tensors))
        along = _Along(kind, target, tensors, size, floor)
        direction = VectorDirection(
            [self.moved[i] for i in tensors],
            [self.grads[i] for i in tensors],
            [self.grads[i] for i in tensors],
            1.0 / size,
            components_norm=size,
        )
        evaluations = 0
        stencil = self.measurements.stencil(direction, step, PAIR_OFFSETS if screen_first else FULL_OFFSETS)
        evaluations += len(stencil.points)
        if screen_first and math.isfinite(self.loss_noise):
            assessment = self._screen(stencil)
            judgement = judge(assessment, stencil, floor, self.multiple)
            if judgement.verdict == "ok":
                return self._finish(along, stencil, assessment, judgement, evaluations)
        if not stencil.full:
            stencil = stencil.extended(self.measurements.points(direction, step, HALF_OFFSETS))
            evaluations += 2
        assessment = self._assess(stencil)
        judgement = judge(assessment, stencil, floor, self.multiple)
        if kind == ProbeKind.DESCENT and stencil.finite:
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
        return self._finish(along, stencil, assessment, judgement, evaluations)

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
        self, along: _Along, stencil: Stencil, assessment: Assessment, judgement: Judgement, evaluations: int
    ) -> Measured:
        numeric = assessment.numeric
        probe = Probe(
            kind=along.kind,
            target=along.target,
            index=None,
            analytic=stencil.analytic,
            numeric=numeric,
            rel_error=abs(numeric - stencil.analytic) / max(abs(numeric), abs(stencil.analytic), self.scale_floor),
            verdict=judgement.verdict,  # type: ignore[arg-type]
            noise=assessment.noise,
            step=stencil.step,
            reason=Reason(judgement.reason),
            evaluations=evaluations,
            floor=along.floor,
        )
        return Measured(probe, along.tensors, 1.0 / along.size, judgement.tolerance, judgement.excess)


@dataclass(frozen=True)
class AppliedPlan:
    """What the probes of an applied check are asked to do: the gradient they measure and how they judge it.

    Attributes:
        names: The checked parameters' names.
        applied: The applied gradient, one tensor per checked parameter (this rank's rows of it when sharded).
        native: The parameters' dtype (the most precise of them).
        path_dtype: The precision of the training's path (its autocast dtype, else ``native``).
        multiple: How many noise floors of the path a gradient may be off.
        tensor_probes: Tensors probed along their own applied gradient per check, in turn (every tensor once a
            probe fails).
        rotation: Which turn of tensors this check probes.
    """

    names: list[str]
    applied: list[Tensor]
    native: torch.dtype
    path_dtype: torch.dtype
    multiple: float
    tensor_probes: int
    rotation: int


def measure(evaluator: LossEvaluator, plan: AppliedPlan, floors: list[float], loss: float) -> list[Measured]:
    """The probes of ``plan`` around the window's ``loss``, judged against the path's ``floors`` per tensor: on
    float64 storage where the model runs in float64 (else natively, float64 reductions)."""
    named = list(evaluator.params)
    elements = sum(p.numel() for _, p in named)
    with exact_conditions():
        float64 = resolve_precision("auto", plan.native, elements) == "float64"
        if float64 and sharding_active() is not None:
            text = "float64 probes are not made on shards (FSDP gathers parameters in their own dtype)"
            evaluator.notes.append(Note(NoteCode.SHARDED_NATIVE, text))
        elif float64:
            try:
                with float64_storage(evaluator.model) as substitutes:
                    evaluator.params = [(n, substitutes.get(id(p), p)) for n, p in named]
                    evaluator.use_float64_inputs()
                    return _probes_at(evaluator, plan, floors, loss, torch.float64)
            except CheckAbandonedError:
                raise
            except Exception as error:  # no float64 kernel, a tensor made in float32 inside: probe natively
                text = f"probes run natively: the loss raised {type(error).__name__} in float64"
                evaluator.notes.append(Note(NoteCode.APPLIED_NATIVE, text))
            finally:
                evaluator.params = named
                evaluator.use_native_inputs()
        return _probes_at(evaluator, plan, floors, loss, plan.native)


def _probes_at(
    evaluator: LossEvaluator, plan: AppliedPlan, floors: list[float], loss: float, compute: torch.dtype
) -> list[Measured]:
    center = evaluator.loss()
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
    probes = AppliedProbes(measurements, plan.names, [p for _, p in evaluator.params], plan.applied, floors,
                           plan.multiple, plan.native)  # fmt: skip
    descent = probes.descent()
    measured = [descent] if descent is not None else []
    count, tensor_probes = len(plan.names), plan.tensor_probes
    if (descent is not None and descent.probe.verdict == "fail") or tensor_probes >= count:
        order = list(range(count))
    else:
        first = (plan.rotation * tensor_probes) % count
        order = [(first + k) % count for k in range(tensor_probes)]
    for i in order:
        found = probes.tensor(i)
        if found is not None:
            measured.append(found)
    if any(m.probe.verdict == "fail" for m in measured) and len(order) < count:
        for i in sorted(set(range(count)) - set(order)):  # name every tensor at fault
            found = probes.tensor(i)
            if found is not None:
                measured.append(found)
    return measured
