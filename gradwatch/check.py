"""One gradient check of a model on a batch: :func:`check_gradients`.

The check computes the reference gradient with autograd, then probes the loss with finite differences:

1. the descent probe, along the normalised gradient ``ĝ`` of all parameters (the largest signal any direction can
   give, so the most sensitive test of the gradient as a whole, and the descent ratio users watch);
2. coordinate probes on parameters, stratified by tensor, which say *where* a gradient is wrong;
3. coordinate probes on the floating tensors of the batch, which check the gradient flowing into the inputs.

Every probe judges itself against its own error estimate (see :mod:`gradwatch.numerics`); a probe that looks wrong is
measured again at an independent step before it may fail. Whatever happens, the model's parameters, buffers,
``.grad``, random states and modes are left exactly as they were.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch import _validation as validate
from gradwatch.evaluation import LossEvaluator, LossFn, Reference, probe_conditions
from gradwatch.numerics import (
    CONFIRMATION_STEP,
    KINK_RETRY_STEP,
    Assessment,
    assess,
    confirm,
    machine_epsilon,
    relative_step,
    relative_tolerance,
)
from gradwatch.probes import CoordinateDirection, Direction, GradientDirection, measure
from gradwatch.report import DESCENT_TARGET, CheckReport, Probe, ProbeKind, Verdict
from gradwatch.sampling import generator, sample_coordinates
from gradwatch.state import TrainingState

REPRODUCIBILITY_TOLERANCE = 1e-4
"""Relative difference allowed between the reference loss and a gradient-free evaluation at the same point. Larger
means the evaluations do not compute the same function (random draws that cannot be replayed, or kernels that differ
with and without autograd), and finite differences would not be comparable with autograd."""


def check_gradients(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    step: int = 0,
    param_probes: int = 8,
    input_probes: int = 2,
    rtol: float | None = None,
    seed: int = 0,
    rotation: int | None = None,
    float64_reductions: bool = True,
) -> CheckReport:
    """Check that autograd's gradient of ``loss_fn(model, batch)`` is the derivative of the loss.

    Args:
        model: The module whose trainable floating parameters are checked.
        batch: Anything ``loss_fn`` accepts; its floating tensors (found inside tuples, lists, dicts, namedtuples and
            dataclasses) are probed as inputs. It is never modified.
        loss_fn: ``loss_fn(model, batch) -> scalar Tensor``. Called about ``4 × (param_probes + input_probes + 1) + 3``
            times, with the random state replayed each time so dropout draws the same masks.
        step: The training step, recorded on the report and used to draw the probed coordinates.
        param_probes: Coordinate probes on parameters (stratified by tensor; 0 to skip).
        input_probes: Coordinate probes on floating inputs of the batch (0 to skip).
        rtol: Relative tolerance; ``None`` picks it from the parameters' dtype (1e-3 for float32, 1e-6 for float64).
        seed: Seed of the coordinate sampling; the same ``seed`` and ``step`` probe the same coordinates.
        rotation: Which window of tensors the coordinate probes cover (see :mod:`gradwatch.sampling`); defaults to
            ``step``. A caller running a series of checks passes the check's position in the series.
        float64_reductions: Accumulate the loss's final sums and means in float64 during finite differences
            (see :mod:`gradwatch.reductions`). Turn off only to study the effect.

    Returns:
        A :class:`~gradwatch.report.CheckReport`. ``report.verdict`` is ``"fail"`` if any probe failed.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``loss_fn`` is not callable or does not return a tensor.
        ValueError: An argument is out of range, or ``loss_fn`` returns a non-scalar or a loss without a graph.

    Example:
        >>> import torch
        >>> from gradwatch import check_gradients
        >>> model = torch.nn.Linear(4, 2)
        >>> batch = (torch.randn(8, 4), torch.randn(8, 2))
        >>> report = check_gradients(model, batch, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
        >>> report.verdict
        'ok'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module; got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable as loss_fn(model, batch); got {type(loss_fn).__name__}")
    validate.check_int("step", step, minimum=0)
    validate.check_int("param_probes", param_probes, minimum=0)
    validate.check_int("input_probes", input_probes, minimum=0)
    validate.check_fraction("rtol", rtol, optional=True)
    validate.check_int("seed", seed, minimum=0)
    validate.check_optional_int("rotation", rotation, minimum=0)
    validate.check_bool("float64_reductions", float64_reductions)

    started = time.perf_counter()
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]
    dtype = _least_precise([p.dtype for _, p in params])
    settings = _Settings(
        rtol=rtol if rtol is not None else relative_tolerance(dtype),
        param_probes=param_probes,
        input_probes=input_probes,
        step=step,
        seed=seed,
        rotation=step if rotation is None else rotation,
    )
    state = TrainingState.capture(model)
    try:
        with probe_conditions():
            evaluator = LossEvaluator(model, batch, loss_fn, params, state, float64_reductions)
            reference = evaluator.reference(with_inputs=input_probes > 0)
            probes = _nonfinite_probes(reference, params) or _Prober(evaluator, reference, settings).run()
    finally:
        state.restore()
    return CheckReport(
        step=step,
        verdict=_overall_verdict(probes),
        probes=probes,
        loss=reference.loss,
        n_forward=evaluator.n_forward,
        n_backward=evaluator.n_backward,
        duration_s=time.perf_counter() - started,
        notes=list(evaluator.notes),
    )


@dataclass(frozen=True)
class _Settings:
    rtol: float
    param_probes: int
    input_probes: int
    step: int
    seed: int
    rotation: int


def _least_precise(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    return max(dtypes, key=machine_epsilon, default=torch.float32)


def _rms(*tensors: Tensor) -> float:
    """Root mean square over all elements of the tensors, accumulated in float64 one tensor at a time."""
    count = sum(t.numel() for t in tensors)
    if count == 0:
        return 0.0
    total = sum(torch.linalg.vector_norm(t.detach(), dtype=torch.float64).item() ** 2 for t in tensors)
    return math.sqrt(total / count)


def _overall_verdict(probes: Sequence[Probe]) -> Verdict:
    if any(p.verdict == "fail" for p in probes):
        return "fail"
    descent = next((p for p in probes if p.kind == "descent"), None)
    if descent is not None:
        return descent.verdict
    return "ok" if any(p.verdict == "ok" for p in probes) else "inconclusive"


def _nonfinite_probes(reference: Reference, params: Sequence[tuple[str, nn.Parameter]]) -> list[Probe]:
    """A failing probe for a non-finite loss, or for each parameter whose gradient has a non-finite entry."""
    if not math.isfinite(reference.loss):
        return [_nonfinite_probe("loss", "loss", None, reference.loss)]
    probes = []
    for (name, _), grad in zip(params, reference.param_grads, strict=True):
        if grad is not None and not bool(torch.isfinite(grad).all()):
            position = (~torch.isfinite(grad)).nonzero()[0]
            index = tuple(int(i) for i in position)
            probes.append(_nonfinite_probe("param", name, index, grad[index].item()))
    return probes


def _nonfinite_probe(kind: ProbeKind, target: str, index: tuple[int, ...] | None, value: float) -> Probe:
    return Probe(kind, target, index, value, math.nan, math.inf, "fail", math.nan, 0.0, "nonfinite")


class _Prober:
    """The probes of one check, sharing its evaluator, reference gradient and scales."""

    def __init__(self, evaluator: LossEvaluator, reference: Reference, settings: _Settings) -> None:
        self.evaluator = evaluator
        self.reference = reference
        self.settings = settings
        self.params = evaluator.params
        self.grads = [
            g if g is not None else torch.zeros_like(p)
            for (_, p), g in zip(self.params, reference.param_grads, strict=True)
        ]
        self.dtype = _least_precise([p.dtype for _, p in self.params])
        self.param_scale = _rms(*(p for _, p in self.params))
        self.grad_scale = _rms(*self.grads)
        self.center = math.nan

    def run(self) -> list[Probe]:
        if not self._reproducible():
            return []
        self.center = self.evaluator.loss()
        probes = []
        descent = self._descent_probe()
        if descent is not None:
            probes.append(descent)
        rng = generator(self.settings.seed, self.settings.step)
        probes += self._param_probes(rng)
        probes += self._input_probes(rng)
        return probes

    def _reproducible(self) -> bool:
        """Whether a gradient-free evaluation reproduces the reference loss (else try with autograd recording)."""
        expected = self.reference.loss
        tolerance = REPRODUCIBILITY_TOLERANCE * abs(expected) + 1e-30
        if abs(self.evaluator.native_loss() - expected) <= tolerance:
            return True
        self.evaluator.use_grad_mode()
        value = self.evaluator.native_loss()
        if abs(value - expected) <= tolerance:
            self.evaluator.notes.append(
                "evaluations run with autograd recording: the loss differs under torch.no_grad()"
            )
            return True
        self.evaluator.notes.append(
            f"no probe made: the loss is not reproducible ({expected:.9g} when differentiated, {value:.9g} when "
            "evaluated again with the same random state); it draws randomness gradwatch cannot replay"
        )
        return False

    def _value_epsilon(self) -> float:
        return machine_epsilon(self.evaluator.value_dtype)

    def _assess(self, direction: Direction, step: float, scale_floor: float) -> Assessment:
        stencil = measure(self.evaluator, direction, step, self.center)
        return assess(stencil, rtol=self.settings.rtol, scale_floor=scale_floor, value_epsilon=self._value_epsilon())

    def _judge(self, direction: Direction, step: float, scale_floor: float) -> tuple[Assessment, float]:
        """Assess one direction at ``step``; a suspicious result must be confirmed at an independent step."""
        first = self._assess(direction, step, scale_floor)
        if first.verdict != "fail":
            return first, step
        confirming = step * CONFIRMATION_STEP
        return confirm(first, self._assess(direction, confirming, scale_floor)), confirming

    def _probe(
        self,
        kind: ProbeKind,
        target: str,
        index: tuple[int, ...] | None,
        direction: Direction,
        step: float,
        scale_floor: float,
        retry_kink: bool = False,
    ) -> Probe:
        """Measure one direction (again at a smaller step after a kink, if ``retry_kink``) and make it a Probe."""
        result, used = self._judge(direction, step, scale_floor)
        if retry_kink and result.reason == "kink":
            result, used = self._judge(direction, step * KINK_RETRY_STEP, scale_floor)
        return Probe(
            kind=kind,
            target=target,
            index=index,
            analytic=direction.analytic,
            numeric=result.numeric,
            rel_error=result.rel_error,
            verdict=result.verdict,  # type: ignore[arg-type]
            noise=result.noise,
            step=used,
            reason=result.reason,
        )

    def _tensor_scale(self, tensor: Tensor) -> float:
        """The magnitude a parameter tensor's steps are relative to; the model's when the tensor is all zeros."""
        return max(_rms(tensor), self.param_scale) or 1.0

    def _descent_probe(self) -> Probe | None:
        if not self.params:
            return None
        direction = GradientDirection([p for _, p in self.params], self.grads)
        if direction.norm == 0.0:
            self.evaluator.notes.append("no descent probe: the gradient is exactly zero")
            return None
        # the step's scale along ĝ: each tensor's own magnitude, weighted by its share of the gradient
        weighted = sum(
            self._tensor_scale(p) ** 2 * (torch.linalg.vector_norm(g, dtype=torch.float64).item() / direction.norm) ** 2
            for (_, p), g in zip(self.params, self.grads, strict=True)
        )
        step = relative_step(self.dtype) * math.sqrt(weighted)
        return self._probe("descent", DESCENT_TARGET, None, direction, step, scale_floor=0.0, retry_kink=True)

    def _param_probes(self, rng: random.Random) -> list[Probe]:
        settings = self.settings
        shapes = [tuple(p.shape) for _, p in self.params]
        probes = []
        floor = math.sqrt(machine_epsilon(self.dtype)) * self.grad_scale
        for coordinate in sample_coordinates(shapes, settings.param_probes, rng, settings.rotation):
            name, param = self.params[coordinate.tensor]
            grad = self.grads[coordinate.tensor]
            index = coordinate.index
            direction = CoordinateDirection(param, index, grad[index].item())
            value = direction.value.abs().item()
            step = relative_step(param.dtype) * max(value, self._tensor_scale(param))
            scale_floor = max(2 * _rms(grad), floor)
            probes.append(self._probe("param", name, index, direction, step, scale_floor))
        return probes

    def _input_probes(self, rng: random.Random) -> list[Probe]:
        settings = self.settings
        grads = self.reference.input_grads
        paths = list(grads)
        inputs = [self.evaluator.inputs[path] for path in paths]
        probes = []
        for coordinate in sample_coordinates(
            [tuple(x.shape) for x in inputs], settings.input_probes, rng, settings.rotation
        ):
            path = paths[coordinate.tensor]
            tensor = inputs[coordinate.tensor]
            grad = grads[path]
            index = coordinate.index
            direction = CoordinateDirection(tensor, index, grad[index].item(), self.evaluator.mark_inputs_current)
            step = relative_step(tensor.dtype) * (max(direction.value.abs().item(), _rms(tensor)) or 1.0)
            probes.append(self._probe("input", path, index, direction, step, scale_floor=2 * _rms(grad)))
        return probes
