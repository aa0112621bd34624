"""One gradient check of a model on a batch: :func:`check_gradients`.

The check computes the reference gradient with autograd, then probes the loss with finite differences, with a
portfolio of probes that see different errors:

1. the descent probe, along the normalised gradient ``ĝ`` of all parameters: the largest signal any direction can
   give, so the most precise test of the gradient as a whole, and the descent ratio users watch;
2. tensor probes, along one tensor's own ``g_T/‖g_T‖``: they say *which* tensor is wrong;
3. random probes, along a random unit vector within one tensor: they see errors orthogonal to the gradient, and a
   gradient that is missing altogether (a stray ``.detach()``);
4. coordinate probes on parameters, which say *where* in a tensor;
5. the input probes: along the gradient of the batch's floating inputs, and at single input coordinates.

Certainty is paid for only where it is needed. The descent probe is a full four-point stencil that measures its own
error; every other probe starts as a two-point screen that borrows that error estimate. A screen that looks wrong is
extended into a full stencil, and a full stencil that still looks wrong is measured again at an independent step
before it may fail. A failure anywhere then sends a tensor probe to every tensor, so the report names the culprit. A
coordinate probe that crossed a kink is replaced by another coordinate. A healthy model costs a fixed, small number of
loss evaluations; a broken one costs what it takes to be sure. On float64 probes those evaluations mostly run
together, in two forward passes (:mod:`gradwatch.vectorized`).

Whatever happens, the model's parameters, buffers, ``.grad``, random states and modes are left exactly as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch import _validation as validate
from gradwatch.batch import ROOT, batch_size, leading_slice
from gradwatch.evaluation import LossEvaluator, LossFn, Reference, probe_conditions
from gradwatch.numerics import (
    CONFIRMATION_STEP,
    HALF_OFFSETS,
    PAIR_OFFSETS,
    UNCHECKABLE_TOLERANCE,
    Assessment,
    Point,
    Stencil,
    assess,
    confirm,
    finer_step,
    gradient_tolerance,
    machine_epsilon,
    relative_step,
    relative_tolerance,
    screen,
    undecided,
)
from gradwatch.precision import PRECISIONS, Precision, float64_storage, resolve_precision
from gradwatch.probes import CoordinateDirection, Direction, Displacement, VectorDirection, measure, norm, norms
from gradwatch.report import DESCENT_TARGET, CheckReport, Probe, ProbeKind, Verdict
from gradwatch.sampling import generator, rotating_window, sample_coordinates
from gradwatch.state import TrainingState
from gradwatch.vectorized import VectorizedLoss, memory_budget, obstacle

REPRODUCIBILITY_TOLERANCE = 1e-4
"""Relative difference allowed between the reference loss and a gradient-free evaluation at the same point (more for
16-bit models, whose own rounding is larger). Larger means the evaluations do not compute the same function (random
draws that cannot be replayed, or kernels that differ with and without autograd), and finite differences would not be
comparable with autograd."""

BATCH_NORM_SAMPLES = 4
"""The slice probes fall back to when the loss refuses a smaller one (BatchNorm in training mode refuses one sample).
Not two: BatchNorm over two samples maps each feature to about ±1, a function so sharply curved (where the two are
close) that float32 autograd's round-off on a bias before it rivals the model's gradient."""

FLOAT64_AGREEMENT = 1e-2
"""Relative difference allowed between the reference loss and the same loss evaluated on float64 storage. Float rounding
accounts for far less; more means the float64 evaluation is not the same function (randomness that was not replayed);
smaller differences of that kind cannot produce a failure either, as they do not reproduce at a second step."""

FULL_FOOTPRINT = 4
"""Loss evaluations of a full stencil (``±h`` and ``±h/2``)."""


def check_gradients(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    step: int = 0,
    tensor_probes: int = 6,
    random_probes: int = 1,
    param_probes: int = 1,
    input_probes: int = 1,
    probe_batch_size: int | None = None,
    precision: Precision = "auto",
    ignore: Sequence[str] = (),
    focus: Sequence[str] = (),
    rtol: float | None = None,
    seed: int = 0,
    rotation: int | None = None,
    float64_reductions: bool = True,
    vectorize: bool = True,
) -> CheckReport:
    """Check that autograd's gradient of ``loss_fn(model, batch)`` is the derivative of the loss.

    Args:
        model: The module whose trainable floating parameters are checked.
        batch: Anything ``loss_fn`` accepts; its floating tensors (found inside tuples, lists, dicts, namedtuples and
            dataclasses) are probed as inputs. It is never modified.
        loss_fn: ``loss_fn(model, batch) -> scalar Tensor``. A check evaluates it at least
            ``6 + 2 × (tensor_probes + random_probes + param_probes + input_probes)`` times (24 by default), more for
            screens that need a full stencil, with the random state replayed each time so dropout draws the same masks.
            In vectorised passes one call, under ``torch.func.vmap``, evaluates many points.
        step: The training step, recorded on the report and used to draw the probed coordinates and directions.
        tensor_probes: Tensors probed along their own gradient per check (in turn; every tensor after a failure).
        random_probes: Tensors probed along a random direction per check (in turn), besides every tensor that
            received no gradient at all.
        param_probes: Coordinate probes on parameters (stratified by tensor; 0 to skip).
        input_probes: Probes on the floating inputs of the batch: the first along their gradient, the others at
            single coordinates (0 to skip input probes and the input gradient altogether).
        probe_batch_size: Check the loss of the first this many samples of the batch (every tensor whose first
            dimension is the batch size is cut), which makes every evaluation cheaper; ``None`` for the whole batch.
            The loss checked is exactly the loss of that slice, so verdicts stay exact.
        precision: ``"native"`` evaluates probes in the parameters' dtype, ``"float64"`` on float64 storage of the
            parameters, buffers and inputs (the analytic gradient is still the native one), ``"auto"`` picks float64
            unless the model has more than 2**25 parameter elements. See :mod:`gradwatch.precision`.
        ignore: Shell-style patterns (``fnmatch``) of parameter names not to check, e.g. ``["quantizer.*"]`` for a
            straight-through estimator whose gradient is deliberately not the derivative.
        focus: Names of parameters to probe along their gradient in this check besides the tensors whose turn it is:
            in a series of checks, the previous report's :attr:`~gradwatch.report.CheckReport.undecided`, so that a
            tensor whose probe could not decide (it crossed a kink) is looked at again at the next point.
        rtol: Relative tolerance; ``None`` picks it from the parameters' dtype (5e-4 for float32, 1e-7 for float64).
            Either is raised to about ``4 ε / |loss|`` for a loss near zero, where autograd's own rounding is that
            large (``report.rtol`` says what was used); below a float32 loss of ~1e-5 no probe is made.
        seed: Seed of the sampling; the same ``seed`` and ``step`` probe the same coordinates and directions.
        rotation: Which window of tensors the probes cover (see :mod:`gradwatch.sampling`); defaults to ``step``. A
            caller running a series of checks passes the check's position in the series.
        float64_reductions: Accumulate the loss's final sums and means in float64 during finite differences
            (see :mod:`gradwatch.reductions`). Turn off only to study the effect.
        vectorize: Evaluate the points of float64 probes together, in few forward passes with ``torch.func.vmap``
            (see :mod:`gradwatch.vectorized`); losses vmap cannot run are evaluated point by point either way. Turn
            off for a loss with side effects that must happen once per point (a forward hook that records
            activations).

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
    for name, value in (
        ("tensor_probes", tensor_probes),
        ("random_probes", random_probes),
        ("param_probes", param_probes),
        ("input_probes", input_probes),
    ):
        validate.check_int(name, value, minimum=0)
    validate.check_optional_int("probe_batch_size", probe_batch_size, minimum=1)
    validate.check_choice("precision", precision, PRECISIONS)
    ignore = validate.check_patterns("ignore", ignore)
    focus = validate.check_patterns("focus", focus)
    validate.check_fraction("rtol", rtol, optional=True)
    validate.check_int("seed", seed, minimum=0)
    validate.check_optional_int("rotation", rotation, minimum=0)
    validate.check_bool("float64_reductions", float64_reductions)
    validate.check_bool("vectorize", vectorize)

    started = time.perf_counter()
    params: list[tuple[str, Tensor]] = [
        (name, p)
        for name, p in model.named_parameters()
        if p.requires_grad and p.is_floating_point() and not any(fnmatch.fnmatchcase(name, pat) for pat in ignore)
    ]
    unknown = sorted(set(focus) - {name for name, _ in model.named_parameters()})
    if unknown:
        raise ValueError(f"`focus` must name parameters of the model; got {unknown}, which are not")
    dtype = _least_precise([p.dtype for _, p in params])
    floating_elements = sum(p.numel() for p in model.parameters() if p.is_floating_point())
    mode = resolve_precision(precision, dtype, floating_elements)
    settings = _Settings(
        rtol=rtol if rtol is not None else relative_tolerance(dtype),
        tensor_probes=tensor_probes,
        random_probes=random_probes,
        param_probes=param_probes,
        input_probes=input_probes,
        step=step,
        seed=seed,
        rotation=step if rotation is None else rotation,
        focus=focus,
        native_dtype=dtype,
        float64_refinement=precision == "auto" and mode == "native" and dtype != torch.float64,
        vectorize=vectorize,
    )
    state = TrainingState.capture(model)
    notes: list[str] = []
    used_precision = "native"
    vectorized: bool | None = None
    try:
        with probe_conditions():
            evaluator, reference, probe_batch = _reference_on_a_slice(
                model, batch, loss_fn, params, state, probe_batch_size, input_probes > 0, float64_reductions, notes
            )
            evaluator.notes[:0] = notes
            grads = [
                g if g is not None else p.new_zeros(()) for (_, p), g in zip(params, reference.param_grads, strict=True)
            ]
            grad_norms = norms(grads, exact=True)
            probes = _nonfinite_probes(reference, params, grad_norms)
            asked = settings.rtol
            settings = dataclasses.replace(settings, rtol=gradient_tolerance(asked, reference.loss, dtype))
            if not probes and settings.rtol > max(asked, UNCHECKABLE_TOLERANCE):
                evaluator.notes.append(
                    f"no probe made: the loss ({reference.loss:.3g}) is so close to zero that the rounding of its "
                    f"{str(dtype).removeprefix('torch.')} gradient alone may reach {settings.rtol:.0%}"
                )
            elif not probes:
                with _probe_precision(model, evaluator, mode) as (used, trial):
                    used_precision = used
                    prober = _Prober(evaluator, reference, settings, grad_norms, center=trial)
                    probes = prober.run()
                    vectorized = None if prober.vectorized is None else prober.vectorized.outcome
    finally:
        state.restore()
    return CheckReport(
        step=step,
        verdict=_overall_verdict(probes),
        probes=probes,
        loss=reference.loss,
        n_forward=evaluator.n_forward,
        n_backward=evaluator.n_backward,
        n_passes=evaluator.n_passes,
        duration_s=time.perf_counter() - started,
        notes=list(evaluator.notes),
        samples=batch_size(probe_batch),
        precision=used_precision,
        vectorized=vectorized,
        rtol=settings.rtol,
    )


def _reference_on_a_slice(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    params: list[tuple[str, Tensor]],
    state: TrainingState,
    probe_batch_size: int | None,
    with_inputs: bool,
    float64_reductions: bool,
    notes: list[str],
) -> tuple[LossEvaluator, Reference, Any]:
    """The evaluator and reference gradient on the first ``probe_batch_size`` samples, or else on the first
    :data:`BATCH_NORM_SAMPLES`, or else on the whole batch: the first the loss accepts (a note says why).

    One sample is the slice most losses accept and BatchNorm refuses (train-mode statistics need two values per
    channel); others refuse any slice (a batch-size constant, a tensor of the full size that was not cut).
    """
    sizes = [] if probe_batch_size is None else [probe_batch_size]
    if probe_batch_size is not None and probe_batch_size < BATCH_NORM_SAMPLES:
        sizes.append(BATCH_NORM_SAMPLES)
    refused = False
    for size in sizes:
        probe_batch = leading_slice(batch, size)
        if probe_batch is batch:
            break
        evaluator = LossEvaluator(model, probe_batch, loss_fn, params, state, float64_reductions)
        try:
            return evaluator, evaluator.reference(with_inputs=with_inputs), probe_batch
        except Exception as error:
            refused = True
            notes.append(f"the loss raised {type(error).__name__} on the first {size} sample(s) ({error})")
    if refused:
        notes.append("probes use the whole batch")
    evaluator = LossEvaluator(model, batch, loss_fn, params, state, float64_reductions)
    return evaluator, evaluator.reference(with_inputs=with_inputs), batch


@contextlib.contextmanager
def _probe_precision(model: nn.Module, evaluator: LossEvaluator, mode: str) -> Iterator[tuple[str, float]]:
    """Evaluate the probes on float64 storage if ``mode`` asks for it; yields the precision actually used and the loss
    of the trial evaluation in float64 (NaN if none), which the probes take as their centre.

    Falls back to the native precision, with a note, when the loss does not run in float64 (an operation without a
    float64 kernel, a tensor created in float32 inside the model).
    """
    if mode != "float64":
        yield "native", math.nan
        return
    native_params = evaluator.params
    with float64_storage(model) as substitutes:
        evaluator.params = [(name, substitutes.get(id(p), p)) for name, p in native_params]
        evaluator.use_float64_inputs()
        try:
            trial = evaluator.loss()
        except Exception as error:
            problem = f"the loss raised {type(error).__name__} in float64 ({error})"
        else:
            yield "float64", trial
            return
        finally:
            evaluator.params = native_params
    evaluator.notes.append(f"probes run in the native precision: {problem}")
    evaluator.use_native_inputs()
    yield "native", math.nan


@dataclass(frozen=True)
class _Settings:
    rtol: float
    tensor_probes: int
    random_probes: int
    param_probes: int
    input_probes: int
    step: int
    seed: int
    rotation: int
    focus: tuple[str, ...]
    native_dtype: torch.dtype
    float64_refinement: bool
    vectorize: bool


def _least_precise(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    return max(dtypes, key=machine_epsilon, default=torch.float32)


def _rms(*tensors: Tensor) -> float:
    """Root mean square over all elements of the tensors, accumulated in float64 one tensor at a time."""
    count = sum(t.numel() for t in tensors)
    return norm(tensors) / math.sqrt(count) if count else 0.0


def _overall_verdict(probes: Sequence[Probe]) -> Verdict:
    """ "fail" if any probe failed; "ok" if a probe of the gradient as a whole or of a tensor agreed; else
    "inconclusive"."""
    if any(p.verdict == "fail" for p in probes):
        return "fail"
    if any(p.verdict == "ok" and p.kind in ("descent", "tensor", "input") and p.index is None for p in probes):
        return "ok"
    return "inconclusive"


def _nonfinite_probes(
    reference: Reference, params: Sequence[tuple[str, Tensor]], grad_norms: Sequence[float]
) -> list[Probe]:
    """A failing probe for a non-finite loss, or for each parameter whose gradient has a non-finite entry (only a
    gradient whose norm is not finite is searched for one)."""
    if not math.isfinite(reference.loss):
        return [_nonfinite_probe("loss", "loss", None, reference.loss)]
    probes = []
    for (name, _), grad, size in zip(params, reference.param_grads, grad_norms, strict=True):
        if grad is None or math.isfinite(size):
            continue
        positions = (~torch.isfinite(grad)).nonzero()
        if len(positions):
            index = tuple(int(i) for i in positions[0])
            probes.append(_nonfinite_probe("param", name, index, grad[index].item()))
    return probes


def _nonfinite_probe(kind: ProbeKind, target: str, index: tuple[int, ...] | None, value: float) -> Probe:
    return Probe(kind, target, index, value, math.nan, math.inf, "fail", math.nan, 0.0, "nonfinite")


@dataclass
class _Pending:
    """A probe being measured: its direction, scales and the stencil and assessment so far."""

    kind: ProbeKind
    target: str
    index: tuple[int, ...] | None
    direction: Direction
    step: float
    scale_floor: float
    tensor: int = -1
    missing: bool = False
    stencil: Stencil | None = None
    result: Assessment | None = None
    initial_step: float = 0.0
    evaluations: int = 0

    def __post_init__(self) -> None:
        self.initial_step = self.step

    def probe(self) -> Probe:
        result = self.result
        assert result is not None
        missing = self.missing and result.verdict == "fail"
        return Probe(
            kind=self.kind,
            target=self.target,
            index=self.index,
            analytic=self.direction.analytic,
            numeric=result.numeric,
            rel_error=result.rel_error,
            verdict=result.verdict,  # type: ignore[arg-type]
            noise=result.noise,
            step=self.step,
            reason="missing" if missing else result.reason,
            evaluations=self.evaluations,
        )


class _Prober:
    """The probes of one check, sharing its evaluator, reference gradient, scales and noise estimate."""

    def __init__(
        self,
        evaluator: LossEvaluator,
        reference: Reference,
        settings: _Settings,
        grad_norms: Sequence[float],
        center: float = math.nan,
    ) -> None:
        self.evaluator = evaluator
        self.reference = reference
        self.settings = settings
        self.params = evaluator.params
        self.missing = [g is None for g in reference.param_grads]
        self.grads = [
            g if g is not None else torch.zeros_like(p)
            for (_, p), g in zip(self.params, reference.param_grads, strict=True)
        ]
        self.dtype = _least_precise([p.dtype for _, p in self.params])
        self.compute_dtype = self.dtype
        """The dtype the loss is evaluated in: the parameters' own, or float64 during a float64 re-measurement."""
        param_norms = norms([p for _, p in self.params])
        sizes = [max(p.numel(), 1) for _, p in self.params]
        self.param_rms = [n / math.sqrt(size) for n, size in zip(param_norms, sizes, strict=True)]
        self.param_scale = math.hypot(*param_norms) / math.sqrt(sum(sizes) or 1)
        self.tensor_grad_norms = list(grad_norms)
        self.grad_norm = math.hypot(*self.tensor_grad_norms)
        # Derivatives below this fraction of the model's are negligible: each probe's relative error is floored there,
        # so that autograd's own round-off on a derivative that is truly zero (a bias feeding BatchNorm gets ~1e-8
        # instead of 0 in float32) does not read as a 100% error once float64 measures the zero exactly.
        # The round-off is autograd's, so the fraction follows the gradient's dtype, not that of the probes' storage.
        self.negligible = machine_epsilon(settings.native_dtype) ** (1 / 3)
        self.center = center
        """The loss at the unperturbed point, in the probes' precision (NaN until evaluated)."""
        self.jitter = 0.0
        self.loss_noise = math.inf
        self.rng = generator(settings.seed, settings.step)
        self.vectorized: VectorizedLoss | None = None
        self._measured: dict[tuple[int, float, float], tuple[float, Displacement]] = {}
        """Points evaluated ahead, in vectorised passes, by (probe id, step, offset): :meth:`_measure` takes them."""

    # ---- the flow of a check --------------------------------------------------------------------------------------

    def run(self) -> list[Probe]:
        if not self._reproducible():
            return []
        anchor = self._descent() or self._input_direction()
        if anchor is None:
            self.evaluator.notes.append("no probe made: no parameter or input received a non-zero gradient")
            return []
        screened = self._screens(input_direction=anchor.kind != "input")
        self._start_vectorizing()
        # the anchor's full stencil and every screen, ahead and together where points are vectorised
        self._prefetch([(anchor, PAIR_OFFSETS + HALF_OFFSETS)] + [(p, PAIR_OFFSETS) for p in screened])
        self._anchor(anchor)
        self._screen_and_escalate(screened)
        done = [anchor, *screened]
        self._refine_in_float64(done)
        if any(p.result is not None and p.result.verdict == "fail" for p in done):
            extra = self._localize(done)
            self._refine_in_float64(extra)
            done += extra
        done += self._replace_kinks(done)
        return [p.probe() for p in done]

    def _start_vectorizing(self) -> None:
        """Evaluate points in vectorised passes from now on, if this check can (see :mod:`gradwatch.vectorized`)."""
        if not self.settings.vectorize or self.evaluator.grad_mode:
            return
        reason = obstacle(self.evaluator)
        if reason is None:
            budget = memory_budget([p for _, p in self.params])
            self.vectorized = VectorizedLoss(self.evaluator, self.center, budget)
        elif self.compute_dtype == torch.float64:  # a float64 check that could have been vectorised: say why not
            self.evaluator.notes.append(f"points evaluated one by one: {reason}")

    def _refine_in_float64(self, done: Sequence[_Pending]) -> None:
        """Measure again, on float64 storage, the parameter probes whose native stencils saw a discrepancy beyond the
        tolerance but could not resolve it: float64 removes the round-off, so they end "ok" or "fail"."""
        rtol = self.settings.rtol
        pending = [
            p
            for p in done
            if p.kind in ("descent", "tensor", "random", "param") and p.result is not None and undecided(p.result, rtol)
        ]
        if not pending or not self.settings.float64_refinement:
            return
        native_center = self.center
        try:
            with float64_storage(self.evaluator.model) as substitutes:
                self.compute_dtype = torch.float64
                self.evaluator.use_float64_inputs()
                self.center = self.evaluator.loss()
                if abs(self.center - self.reference.loss) > self._center_tolerance():
                    self.evaluator.notes.append(
                        f"no float64 re-measurement: the loss is {self.center:.9g} in float64, "
                        f"{self.reference.loss:.9g} natively"
                    )
                    pending = []
                for probe in pending:
                    probe.direction.substitute(substitutes)  # perturb the float64 copies the model now uses
                    probe.step = (
                        probe.initial_step * self._relative_step(torch.float64) / self._relative_step(self.dtype)
                    )
                    probe.stencil = None
                    self._full(probe)
        except Exception as error:
            self.evaluator.notes.append(f"no float64 re-measurement: the loss raised {type(error).__name__} ({error})")
            pending = []
        finally:
            self.center = native_center
            self.compute_dtype = self.dtype
            self.evaluator.use_native_inputs()
        if pending:
            self.evaluator.notes.append(f"{len(pending)} undecided probe(s) measured again in float64")

    def _reproducible(self) -> bool:
        """Evaluate the centre; it must reproduce the reference loss (else retry with autograd recording)."""
        expected = self.reference.loss
        tolerance = self._center_tolerance()
        if math.isnan(self.center):
            self.center = self.evaluator.loss()
        if abs(self.center - expected) <= tolerance:
            self._measure_jitter()
            return True
        native = self.evaluator.native_loss()
        if abs(native - expected) > tolerance:
            self.evaluator.use_grad_mode()
            native = self.evaluator.native_loss()
            if abs(native - expected) > tolerance:
                self.evaluator.notes.append(
                    f"no probe made: the loss is not reproducible ({expected:.9g} when differentiated, {native:.9g} "
                    "when evaluated again with the same random state); it draws randomness gradwatch cannot replay"
                )
                return False
            self.evaluator.notes.append(
                "evaluations run with autograd recording: the loss differs under torch.no_grad()"
            )
        self.center = self.evaluator.loss()
        self._measure_jitter()
        return True

    def _center_tolerance(self) -> float:
        """How far the loss at the unperturbed point may be from the reference loss, in loss units.

        In the gradient's own dtype, the two compute the same thing and differ by little more than rounding. In
        float64 they differ by the reference's whole rounding error, which for a loss near zero (a memorised sample's
        cross-entropy, 3e-4) is about its float32 epsilon in absolute terms, not relative to the loss.
        """
        native_epsilon = machine_epsilon(self.settings.native_dtype)
        loss = abs(self.reference.loss)
        if self.compute_dtype == self.settings.native_dtype:
            return max(REPRODUCIBILITY_TOLERANCE, 8 * native_epsilon) * loss + 1e-30
        absolute = 64 * min(native_epsilon, machine_epsilon(torch.float32))
        return max(FLOAT64_AGREEMENT, 8 * native_epsilon) * loss + absolute

    def _measure_jitter(self) -> None:
        """On devices with non-deterministic kernels, evaluate the centre twice: the difference is jitter."""
        tensors = [p for _, p in self.params] + list(self.evaluator.inputs.values())
        if any(t.device.type != "cpu" for t in tensors) and not torch.are_deterministic_algorithms_enabled():
            self.jitter = abs(self.evaluator.loss() - self.center)

    def _anchor(self, anchor: _Pending) -> None:
        """Measure the anchor probe with a full stencil (again at a smaller step after a kink): its error estimate is
        the loss noise the screens borrow."""
        self._full(anchor)
        assert anchor.result is not None
        self.loss_noise = anchor.result.loss_noise

    def _screen_and_escalate(self, pending: Sequence[_Pending]) -> None:
        self._prefetch([(probe, PAIR_OFFSETS) for probe in pending])
        for probe in pending:
            self._screen(probe)
        suspects = [p for p in pending if p.result is not None and p.result.verdict == "suspect"]
        self._prefetch([(probe, HALF_OFFSETS) for probe in suspects])
        for probe in suspects:
            self._full(probe)

    def _localize(self, done: Sequence[_Pending]) -> list[_Pending]:
        """After a failure, a tensor probe for every tensor not probed along its gradient yet, so the report names
        the tensors that are wrong."""
        covered = {p.tensor for p in done if p.kind == "tensor"}
        candidates = [self._tensor_probe(i) for i in range(len(self.params)) if i not in covered]
        extra = [p for p in candidates if p is not None]
        self._screen_and_escalate(extra)
        return extra

    def _replace_kinks(self, done: Sequence[_Pending]) -> list[_Pending]:
        """Another coordinate in the same tensor for every coordinate probe whose stencil crossed a kink."""
        replacements = []
        for probe in done:
            if probe.index is not None and probe.result is not None and probe.result.reason == "kink":
                replacement = self._coordinate_probe(probe.kind, probe.tensor)
                if replacement is not None:
                    replacements.append(replacement)
        self._screen_and_escalate(replacements)
        return replacements

    # ---- measuring ------------------------------------------------------------------------------------------------

    def _value_epsilon(self) -> float:
        return machine_epsilon(self.evaluator.value_dtype)

    def _points(self, probe: _Pending, step: float, offsets: Sequence[float]) -> Stencil:
        return Stencil(step, self.center, probe.direction.analytic, self._measure(probe, step, offsets))

    def _measure(self, probe: _Pending, step: float, offsets: Sequence[float]) -> tuple[Point, ...]:
        """The loss at ``offset × step`` along the probe's direction for each offset: evaluated ahead if it was, else
        now, one point at a time."""
        probe.evaluations += len(offsets)
        keys = {offset: _point_key(probe, step, offset) for offset in offsets}
        known = {offset: self._measured.pop(key) for offset, key in keys.items() if key in self._measured}
        missing = [offset for offset in offsets if offset not in known]
        points = {p.offset: p for p in measure(self.evaluator, probe.direction, step, missing)} if missing else {}
        for offset, (value, displacement) in known.items():
            points[offset] = Point(offset, value, displacement.along, displacement.predicted)
        return tuple(points[offset] for offset in offsets)

    def _prefetch(self, requests: Sequence[tuple[_Pending, Sequence[float]]], step: float | None = None) -> None:
        """Evaluate ahead, together, the points ``offset × probe.step`` (or ``offset × step``) of each
        ``(probe, offsets)`` that are not known yet, when the check evaluates points in vectorised passes."""
        if self.vectorized is None or not self.vectorized.usable:
            return
        wanted: list[tuple[_Pending, float, float]] = []
        for probe, offsets in requests:
            at = probe.step if step is None else step
            wanted += [(probe, at, offset) for offset in offsets if _point_key(probe, at, offset) not in self._measured]
        results = self.vectorized.evaluate([(probe.direction, offset * at) for probe, at, offset in wanted])
        for (probe, at, offset), result in zip(wanted, results, strict=True):
            if result is not None:
                self._measured[_point_key(probe, at, offset)] = result

    def _screen(self, probe: _Pending) -> None:
        probe.stencil = self._points(probe, probe.step, PAIR_OFFSETS)
        probe.result = screen(
            probe.stencil,
            rtol=self.settings.rtol,
            scale_floor=probe.scale_floor,
            value_epsilon=self._value_epsilon(),
            loss_noise=self.loss_noise + self.jitter,
        )

    def _assess(self, stencil: Stencil, scale_floor: float) -> Assessment:
        return assess(
            stencil,
            rtol=self.settings.rtol,
            scale_floor=scale_floor,
            value_epsilon=self._value_epsilon(),
            jitter=self.jitter,
        )

    def _full(self, probe: _Pending) -> None:
        """Complete the probe's stencil (reusing a screen's ``±h``) and judge it; a failure must be confirmed by an
        independent stencil at a smaller step. A probe along a whole direction that stays undecided (kinks, round-off)
        is measured once more at a finer step, where it crosses fewer kinks; a coordinate is replaced instead."""
        self._full_at_step(probe)
        result = probe.result
        assert result is not None
        if probe.index is not None or not undecided(result, self.settings.rtol):
            return
        finer = finer_step(
            probe.step,
            center=self.center,
            scale=result.scale,
            rtol=self.settings.rtol,
            compute_epsilon=machine_epsilon(self.compute_dtype),
        )
        if finer is not None:
            probe.step = finer
            probe.stencil = None
            self._prefetch([(probe, PAIR_OFFSETS + HALF_OFFSETS)])
            self._full_at_step(probe)

    def _full_at_step(self, probe: _Pending) -> None:
        if probe.stencil is None or probe.stencil.step != probe.step:
            probe.stencil = self._points(probe, probe.step, PAIR_OFFSETS)
        probe.stencil = probe.stencil.extended(self._measure(probe, probe.step, HALF_OFFSETS))
        first = self._assess(probe.stencil, probe.scale_floor)
        if first.verdict != "fail":
            probe.result = first
            return
        confirming = probe.step * CONFIRMATION_STEP
        self._prefetch([(probe, PAIR_OFFSETS + HALF_OFFSETS)], step=confirming)
        second = self._points(probe, confirming, PAIR_OFFSETS + HALF_OFFSETS)
        probe.result = confirm(first, self._assess(second, probe.scale_floor))
        probe.step = confirming

    # ---- the probes -----------------------------------------------------------------------------------------------

    def _relative_step(self, dtype: torch.dtype) -> float:
        """The step, relative to the magnitude moved, of a probe evaluated in ``dtype`` (see :func:`relative_step`)."""
        return relative_step(dtype, self.settings.native_dtype)

    def _tensor_scale(self, i: int) -> float:
        """The magnitude the steps in parameter ``i`` are relative to; the model's when the tensor is all zeros."""
        return max(self.param_rms[i], self.param_scale) or 1.0

    def _descent(self) -> _Pending | None:
        if not self.params or self.grad_norm == 0.0:
            return None
        direction = VectorDirection(
            [p for _, p in self.params], self.grads, self.grads, 1.0 / self.grad_norm, components_norm=self.grad_norm
        )
        # the step's scale along ĝ: each tensor's own magnitude, weighted by its share of the gradient
        weighted = sum(
            self._tensor_scale(i) ** 2 * (share / self.grad_norm) ** 2 for i, share in enumerate(self.tensor_grad_norms)
        )
        step = self._relative_step(self.dtype) * math.sqrt(weighted)
        return _Pending("descent", DESCENT_TARGET, None, direction, step, scale_floor=0.0)

    def _input_direction(self) -> _Pending | None:
        grads = self.reference.input_grads
        paths = [path for path, g in grads.items() if bool(g.any())]
        if not paths or self.settings.input_probes == 0:
            return None
        tensors = [self.evaluator.inputs[path] for path in paths]
        components = [grads[path] for path in paths]
        size = norm(components)
        direction = VectorDirection(tensors, components, components, 1.0 / size, self.evaluator.mark_inputs_current)
        step = self._relative_step(tensors[0].dtype) * (_rms(*tensors) or 1.0)
        target = paths[0] if len(paths) == 1 else ROOT  # "batch": all its floating tensors
        return _Pending("input", target, None, direction, step, scale_floor=0.0)

    def _screens(self, input_direction: bool) -> list[_Pending]:
        """The screening probes of a check: tensors in turn, random directions (first where a gradient is missing),
        parameter coordinates, the input direction and input coordinates."""
        settings = self.settings
        count = len(self.params)
        pending: list[_Pending | None] = []
        with_gradient = [i for i in range(count) if self.tensor_grad_norms[i] > 0]
        window = rotating_window(len(with_gradient), settings.tensor_probes, settings.rotation)
        turn = [with_gradient[i] for i in window]
        focused = [i for i, (name, _) in enumerate(self.params) if name in settings.focus]
        pending += [self._tensor_probe(i) for i in dict.fromkeys(turn + focused)]
        missing = [i for i in range(count) if self.missing[i]]
        others = [i for i in range(count) if not self.missing[i]]
        chosen = [missing[i] for i in rotating_window(len(missing), max(settings.random_probes, 4), settings.rotation)]
        chosen += [others[i] for i in rotating_window(len(others), settings.random_probes, settings.rotation + 1)]
        pending += [self._random_probe(i) for i in chosen]
        shapes = [tuple(p.shape) for _, p in self.params]
        for coordinate in sample_coordinates(shapes, settings.param_probes, self.rng, settings.rotation):
            pending.append(self._coordinate_probe("param", coordinate.tensor, coordinate.index))
        if input_direction:
            pending.append(self._input_direction())
        pending += self._input_coordinates()
        return [p for p in pending if p is not None]

    def _tensor_probe(self, i: int) -> _Pending | None:
        name, param = self.params[i]
        grad = self.grads[i]
        size = self.tensor_grad_norms[i]
        if size == 0.0:
            return None
        direction = VectorDirection([param], [grad], [grad], 1.0 / size, components_norm=size)
        step = self._relative_step(param.dtype) * self._tensor_scale(i)
        floor = self.negligible * self.grad_norm
        return _Pending("tensor", name, None, direction, step, scale_floor=floor, tensor=i)

    def _random_probe(self, i: int) -> _Pending:
        name, param = self.params[i]
        grad = self.grads[i]
        generator = torch.Generator().manual_seed(self.rng.getrandbits(63))
        vector = torch.randn(param.shape, generator=generator, dtype=torch.float64)
        vector = vector.div_(torch.linalg.vector_norm(vector)).to(device=param.device, dtype=param.dtype)
        direction = VectorDirection([param], [vector], [grad])
        step = self._relative_step(param.dtype) * self._tensor_scale(i)
        # |r·g| is about ‖g_T‖/√n for a random unit r; a tensor without gradient is compared with the whole model's
        expected = max(self.tensor_grad_norms[i], self.negligible * self.grad_norm)
        floor = expected / math.sqrt(max(param.numel(), 1))
        return _Pending("random", name, None, direction, step, floor, tensor=i, missing=self.missing[i])

    def _coordinate_probe(self, kind: ProbeKind, tensor: int, index: tuple[int, ...] | None = None) -> _Pending | None:
        if kind == "input":
            return self._input_coordinate(tensor, index)
        name, param = self.params[tensor]
        if index is None:
            index = _random_index(param.shape, self.rng)
        grad = self.grads[tensor]
        direction = CoordinateDirection(param, index, grad[index].item())
        value = direction.value.abs().item()
        step = self._relative_step(param.dtype) * max(value, self._tensor_scale(tensor))
        grad_rms = self.tensor_grad_norms[tensor] / math.sqrt(max(param.numel(), 1))
        floor = max(2 * grad_rms, self.negligible * self.grad_norm / math.sqrt(param.numel()))
        return _Pending("param", name, index, direction, step, floor, tensor=tensor, missing=self.missing[tensor])

    def _input_coordinates(self) -> list[_Pending | None]:
        grads = self.reference.input_grads
        inputs = [self.evaluator.inputs[path] for path in grads]
        coordinates = sample_coordinates(
            [tuple(x.shape) for x in inputs], self.settings.input_probes - 1, self.rng, self.settings.rotation
        )
        return [self._input_coordinate(c.tensor, c.index) for c in coordinates]

    def _input_coordinate(self, tensor: int, index: tuple[int, ...] | None) -> _Pending | None:
        grads = self.reference.input_grads
        path = list(grads)[tensor]
        working = self.evaluator.inputs[path]
        if index is None:
            index = _random_index(working.shape, self.rng)
        grad = grads[path]
        direction = CoordinateDirection(working, index, grad[index].item(), self.evaluator.mark_inputs_current)
        step = self._relative_step(working.dtype) * (max(direction.value.abs().item(), _rms(working)) or 1.0)
        return _Pending("input", path, index, direction, step, scale_floor=2 * _rms(grad), tensor=tensor)


def _point_key(probe: _Pending, step: float, offset: float) -> tuple[int, float, float]:
    """How a point evaluated ahead is found again: its probe, step and offset."""
    return id(probe), step, offset


def _random_index(shape: torch.Size, rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(size) for size in shape)
