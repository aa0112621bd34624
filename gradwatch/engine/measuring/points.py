"""The measuring service of a check: the loss at the points its probes ask for, around one centre.

Probes ask for the loss at ``offset × step`` along their direction. :class:`Measurements` answers from points
evaluated ahead, together, in vectorised passes (:mod:`.vectorized`) where the check can, and evaluates the others one
by one. It also holds what every stencil of the check shares: the loss at the unperturbed point (the centre), the
jitter of non-deterministic kernels, and the dtype the loss is evaluated in, which a float64 re-measurement changes for
a while (:meth:`Measurements.in_float64`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Hashable, Iterator, Sequence

import torch
from torch import Tensor

from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.function.precision import AUTO_FLOAT64_ELEMENTS, float64_storage
from gradwatch.engine.measuring.directions import CoordinateDirection, Direction, Displacement, VectorDirection
from gradwatch.engine.measuring.vectorized import VectorizedLoss, memory_budget, obstacle
from gradwatch.engine.numerics.stencil import PAIR_OFFSETS, Point, Stencil
from gradwatch.engine.numerics.steps import center_tolerance, machine_epsilon
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.errors import InputsRefusedError, passes_fallbacks

Request = tuple[Direction, float, Sequence[float]]
"""Points to evaluate ahead: a direction, a step and the offsets (in units of the step) along it."""


def measure(evaluator: LossEvaluator, direction: Direction, step: float, offsets: Sequence[float]) -> tuple[Point, ...]:
    """The loss at ``offset × step`` along ``direction`` for each of ``offsets``, one point at a time; an
    :class:`InputsRefusedError` where ``direction`` moves inputs and the loss raises there."""
    inputs = {id(tensor) for tensor in evaluator.inputs.values()}
    moves_inputs = any(id(tensor) in inputs for tensor in getattr(direction, "tensors", ()))  # activations: none
    points = []
    with direction.moving() as move:
        for offset in offsets:
            displacement = move(offset * step)
            try:
                value = evaluator.loss()
            except Exception as error:
                if passes_fallbacks(error) or not moves_inputs:
                    raise
                first_line = (str(error).strip().splitlines() or [""])[0]
                raise InputsRefusedError(f"{type(error).__name__}: {first_line}") from error
            points.append(Point(offset, value, displacement.along, displacement.predicted))
    return tuple(points)


class Measurements:
    """The loss at the points of a check's probes around ``center``, the loss at the unperturbed point in the
    probes' precision, with the ``evaluator`` (on float64 storage for float64 probes); ``jitter``: how much two
    evaluations of the centre differ (non-deterministic kernels), in loss units."""

    def __init__(self, evaluator: LossEvaluator, center: float, jitter: float = 0.0) -> None:
        self.evaluator = evaluator
        self.center = center
        self.jitter = jitter
        self.compute_dtype = max((p.dtype for _, p in evaluator.params), key=machine_epsilon, default=torch.float32)
        """The dtype the loss is evaluated in: the probed parameters' own, or float64 during a re-measurement."""
        self.vectorized: VectorizedLoss | None = None
        self._ahead: dict[tuple[Direction, float, float], tuple[float, Displacement]] = {}
        """Points evaluated ahead, in vectorised passes, by (direction, step, offset): :meth:`points` takes them."""

    @property
    def value_epsilon(self) -> float:
        """The machine epsilon of the dtype the loss values are delivered in (float64 when the float64 reductions
        reached the final loss): no probe resolves finer than that."""
        return machine_epsilon(self.evaluator.value_dtype)

    @property
    def vectorized_outcome(self) -> bool | None:
        """Whether points were evaluated in vectorised passes (see :attr:`VectorizedLoss.outcome`); ``None`` if the
        check did not try."""
        return None if self.vectorized is None else self.vectorized.outcome

    def start_vectorizing(self) -> None:
        """Evaluate points ahead in vectorised passes from now on, if the loss allows it (:func:`obstacle`)."""
        if self.evaluator.grad_mode:
            return
        reason = obstacle(self.evaluator)
        if reason is None:
            budget = memory_budget([p for _, p in self.evaluator.params])
            self.vectorized = VectorizedLoss(self.evaluator, self.center, budget)
        elif self.compute_dtype == torch.float64:  # a float64 check that could have been vectorised: say why not
            self.evaluator.notes.append(Note(reason.code, f"points evaluated one by one: {reason}"))

    def prefetch(self, requests: Sequence[Request]) -> None:
        """Evaluate the requested points not known yet ahead, together, when the check vectorises."""
        if self.vectorized is None or not self.vectorized.usable:
            return
        wanted = [
            (direction, step, offset)
            for direction, step, offsets in requests
            for offset in offsets
            if (direction, step, offset) not in self._ahead
            and isinstance(direction, CoordinateDirection | VectorDirection)  # hooked directions: one by one
        ]
        results = self.vectorized.evaluate([(direction, offset * step) for direction, step, offset in wanted])
        for key, result in zip(wanted, results, strict=True):
            if result is not None:
                self._ahead[key] = result

    def points(self, direction: Direction, step: float, offsets: Sequence[float]) -> tuple[Point, ...]:
        """The loss at ``offset × step`` along ``direction`` for each offset: evaluated ahead, else now."""
        known = {
            offset: self._ahead.pop(key) for offset in offsets if (key := (direction, step, offset)) in self._ahead
        }
        missing = [offset for offset in offsets if offset not in known]
        found = {p.offset: p for p in measure(self.evaluator, direction, step, missing)} if missing else {}
        for offset, (value, displacement) in known.items():
            found[offset] = Point(offset, value, displacement.along, displacement.predicted)
        return tuple(found[offset] for offset in offsets)

    def stencil(self, direction: Direction, step: float, offsets: Sequence[float]) -> Stencil:
        """The stencil of the points ``offset × step`` along ``direction``, around the centre."""
        return Stencil(step, self.center, direction.analytic, self.points(direction, step, offsets))

    def screen(self, direction: Direction, step: float, key: Hashable = None) -> Stencil:
        """A two-point screen along ``direction`` (``±step``), around the centre; ``key`` names the probe, for a
        service that keeps screens for another pass over the same point (an applied check's)."""
        return self.stencil(direction, step, PAIR_OFFSETS)

    def centred(self, stencil: Stencil) -> Stencil:
        """``stencil`` around the loss at the centre, before the ladder completes it into a full stencil (whose fourth
        difference uses the centre): the centre is known here, so ``stencil`` itself."""
        return stencil

    @contextlib.contextmanager
    def in_float64(
        self, reference_loss: float, native_dtype: torch.dtype, moved: Collection[int] = ()
    ) -> Iterator[dict[int, Tensor] | None]:
        """Evaluate on float64 storage for the duration (:func:`float64_storage`), around the float64 centre; beyond
        :data:`AUTO_FLOAT64_ELEMENTS` only ``moved`` (the ``id`` of the parameters the probes move) get float64
        substitutes, the rest cast where used. Yields the substitutes by ``id(parameter)``, or ``None``, with a note,
        when the float64 centre is not the ``reference_loss`` autograd computed in ``native_dtype`` (another function).
        The centre, the compute dtype and the evaluator's inputs are put back afterwards."""
        native_center, native_dtype_used = self.center, self.compute_dtype
        try:
            model = self.evaluator.model
            elements = sum(p.numel() for p in model.parameters() if p.is_floating_point() or p.is_complex())
            with float64_storage(model, set(moved) if elements > AUTO_FLOAT64_ELEMENTS else None) as substitutes:
                self.compute_dtype = torch.float64
                self.evaluator.use_float64_inputs()
                self.center = self.evaluator.loss()
                if abs(self.center - reference_loss) > center_tolerance(reference_loss, native_dtype, torch.float64):
                    self.evaluator.notes.append(Note(NoteCode.NO_FLOAT64_REMEASUREMENT, (
                        f"no float64 re-measurement: the loss is {self.center:.9g} in float64, "
                        f"{reference_loss:.9g} natively")))  # fmt: skip
                    yield None
                else:
                    yield substitutes
        finally:
            self.center, self.compute_dtype = native_center, native_dtype_used
            self.evaluator.use_native_inputs()
