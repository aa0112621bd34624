"""Which probes a check makes, and in which turn.

Each kind of probe sees errors the others miss:

1. the descent probe, along the normalised gradient ``ĝ`` of all parameters: the largest signal any direction can
   give, so the most precise test of the gradient as a whole, and the descent ratio users watch;
2. tensor probes, along one tensor's own ``g_T/‖g_T‖``: they say *which* tensor is wrong;
   cover probes (:mod:`.cover`), along groups of the other tensors' gradients, each tensor weighted to contribute
   equally: every tensor at every check, however small its share of ``‖g‖``;
3. random probes, along a random unit vector within one tensor: they see errors orthogonal to the gradient, and a
   gradient that is missing altogether (a stray ``.detach()``);
4. coordinate probes on parameters, which say *where* in a tensor;
5. the input probes: along the gradient of the batch's floating inputs, and at single input coordinates.

Tensor probes take turns (a rotating window, :mod:`.sampling`) and cover probes group the rest, so a healthy check is a
small portfolio whatever the model's size, and a wrong gradient in any tensor shows at the first check. After a failure
every tensor gets a tensor probe (:meth:`Portfolio.localization`), so the report names the tensors that are wrong; a
coordinate probe that crossed a kink is replaced by another coordinate of the same tensor
(:meth:`Portfolio.replacements`).

Steps are relative to the magnitude of what a probe moves (see :func:`~gradwatch.engine.numerics.steps.relative_step`),
and each probe's relative error is floored at the size its derivative can be expected to have, so that a derivative
whose true value is zero does not read as a 100% error.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradwatch.engine.distributed.collective import active, any_rank, every_rank, global_numel, global_shape, value_at
from gradwatch.engine.function.batch import ROOT
from gradwatch.engine.function.evaluation import LossEvaluator, Reference
from gradwatch.engine.measuring.directions import CoordinateDirection, Direction, VectorDirection
from gradwatch.engine.numerics.norms import norm, norms, rms
from gradwatch.engine.numerics.steps import machine_epsilon, relative_step, relative_tolerance
from gradwatch.engine.probing.sampling import CoverGroup, cover_groups, generator, rotating_window, sample_coordinates
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.results.kinds import PROBE_KINDS, ProbeKind
from gradwatch.engine.results.report import DESCENT_TARGET
from gradwatch.engine.settings import ProbeSettings


@dataclass(frozen=True)
class PortfolioTurn:
    """How many probes of each kind a check makes (``probes``: its tensor, random, parameter and input probes and the
    seed), and which turn it is."""

    probes: ProbeSettings  # the check's settings (with input_probes=0 where its inputs are not probed)
    _: dataclasses.KW_ONLY
    step: int  # the training step, which with the seed draws coordinates and directions
    rotation: int  # which window of tensors the probes cover
    focus: tuple[str, ...]  # parameters probed along their gradient besides the tensors whose turn it is
    # coordinates not to probe, by parameter name (a boolean mask): their gradient is zero by design (a padding row)
    exempt: dict[str, Tensor] = dataclasses.field(default_factory=dict)


class Portfolio:
    """The probes of one check, sized from its ``reference`` (the loss and autograd's gradients at the checked point)
    and ``grad_norms`` (the float64 norm of each parameter's gradient, 0 without one): they move the ``evaluator``'s
    parameters (float64 substitutes for float64 probes) and working inputs. ``native_dtype`` is the checked gradient's;
    ``rtol``, the check's tolerance, sizes the cover probes' groups (by default the dtype's)."""

    def __init__(
        self,
        evaluator: LossEvaluator,
        reference: Reference,
        grad_norms: Sequence[float],
        settings: PortfolioTurn,
        native_dtype: torch.dtype,
        *,
        rtol: float | None = None,
    ) -> None:
        self.evaluator = evaluator
        self.reference = reference
        self.settings = settings
        self.native_dtype = native_dtype
        self.rtol = relative_tolerance(native_dtype) if rtol is None else rtol
        self.params = evaluator.params
        self.missing = every_rank([g is None for g in reference.param_grads])
        self.grads = [
            g if g is not None else torch.zeros_like(p)
            for (_, p), g in zip(self.params, reference.param_grads, strict=True)
        ]
        param_norms = norms([p for _, p in self.params])
        self.numels = [global_numel(p) for _, p in self.params]
        sizes = [max(n, 1) for n in self.numels]
        self.param_rms = [n / math.sqrt(size) for n, size in zip(param_norms, sizes, strict=True)]
        self.param_scale = math.hypot(*param_norms) / math.sqrt(sum(sizes) or 1)
        self.tensor_grad_norms = list(grad_norms)
        self.grad_norm = math.hypot(*self.tensor_grad_norms)
        # Derivatives below this fraction of the model's are negligible: each probe's relative error is floored there,
        # so that autograd's own round-off on a derivative that is truly zero (a bias feeding BatchNorm gets ~1e-8
        # instead of 0 in float32) does not read as a 100% error once float64 measures the zero exactly.
        # The round-off is autograd's, so the fraction follows the gradient's dtype, not that of the probes' storage.
        self.negligible = machine_epsilon(native_dtype) ** (1 / 3)
        # A derivative along a unit direction that would move the loss by less than that fraction of itself over the
        # parameters' own size is zero for all a gradient's rounding can tell: when the whole gradient is that small
        # (an exactly constant output, computed as 7e-8 by float32 autograd), it is judged against this, not itself.
        size = self.param_scale * math.sqrt(sum(self.numels)) or 1.0
        self.loss_floor = self.negligible * abs(reference.loss) / size
        self.rng = generator(settings.probes.seed, settings.step)
        self.exempt = {i: settings.exempt[name] for i, (name, _) in enumerate(self.params) if name in settings.exempt}

    def anchor(self) -> ProbeTask | None:
        """The probe whose full stencil sets the check's noise: the descent probe, else the input direction (no
        parameter received a gradient), else a random direction over every parameter (nothing received a non-zero one: a
        flat loss confirms the zero gradient, a moving one shows it missing); ``None`` without parameters."""
        return self._descent() or self._input_direction() or self._random_anchor()

    def replica(self, task: ProbeTask, evaluator: LossEvaluator, reference: Reference) -> ProbeTask:
        """The same probe at another point (shifted, or on other storage): the same unit direction over the tensors
        ``evaluator`` uses there, with the analytic derivative of ``reference``'s gradient."""
        tensors, grads = [], []
        for moved in task.moves:
            if isinstance(moved, int):
                tensor, grad = evaluator.params[moved][1], reference.param_grads[moved]
            else:
                tensor, grad = evaluator.inputs[moved], reference.input_grads.get(moved)
            tensors.append(tensor)
            grads.append(grad if grad is not None else torch.zeros_like(tensor))
        after = evaluator.mark_inputs_current if any(isinstance(m, str) for m in task.moves) else None
        old = task.direction
        direction: Direction
        if isinstance(old, CoordinateDirection):
            direction = CoordinateDirection(tensors[0], old.index, value_at(grads[0], old.index), after)
        else:
            assert isinstance(old, VectorDirection), "only coordinate and vector probes are replicated"
            direction = VectorDirection(tensors, old.components, grads, old.coefficient, after_write=after,
                                        weights=old.weights)  # fmt: skip
        return dataclasses.replace(
            task, direction=direction, step=task.initial_step, stencil=None, result=None, evaluations=0
        )

    def screens(self, input_direction: bool) -> list[ProbeTask]:
        """The screening probes: tensors in turn, cover probes over the other tensors with a gradient, random directions
        (first where a gradient is missing), parameter coordinates, the input direction (unless it is the anchor) and
        input coordinates."""
        settings, probes = self.settings, self.settings.probes
        count = len(self.params)
        pending: list[ProbeTask | None] = []
        with_gradient = [i for i in range(count) if self.tensor_grad_norms[i] > 0]
        window = rotating_window(len(with_gradient), probes.tensor_probes, settings.rotation)
        turn = [with_gradient[i] for i in window]
        focused = [i for i, (name, _) in enumerate(self.params) if name in settings.focus]
        probed = dict.fromkeys(turn + focused)
        pending += [self._tensor_probe(i) for i in probed]
        rest = [i for i in with_gradient if i not in probed]
        floor = self.negligible * self.grad_norm
        pending += [self._cover_probe(group) for group in cover_groups(
            self.tensor_grad_norms, rest, floor, self.rtol, self.rng)]  # fmt: skip
        missing = [i for i in range(count) if self.missing[i]]
        others = [i for i in range(count) if not self.missing[i]]
        chosen = [missing[i] for i in rotating_window(len(missing), max(probes.random_probes, 4), settings.rotation)]
        chosen += [others[i] for i in rotating_window(len(others), probes.random_probes, settings.rotation + 1)]
        pending += [self._random_probe(i) for i in chosen]
        shapes = [tuple(global_shape(p)) for _, p in self.params]
        for coordinate in sample_coordinates(shapes, probes.param_probes, self.rng, settings.rotation):
            pending.append(self._coordinate_probe(ProbeKind.PARAM, coordinate.tensor, coordinate.index))
        if input_direction:
            pending.append(self._input_direction())
        pending += self._input_coordinates()
        return [p for p in pending + self.every_check() if p is not None]

    def every_check(self) -> list[ProbeTask | None]:
        """The probes of the kinds every check makes, recomputed and applied: one from the method each row of the kinds
        table names (:attr:`~gradwatch.engine.results.kinds.KindTraits.made_by`), ``None`` where it has none to make."""
        return [getattr(self, row.made_by)() for row in PROBE_KINDS.values() if row.made_by]

    def localization(self, done: Sequence[ProbeTask]) -> list[ProbeTask]:
        """After a failure: a tensor probe for every tensor not probed along its gradient yet."""
        covered = {task.tensor for task in done if task.kind == ProbeKind.TENSOR}
        candidates = [self._tensor_probe(i) for i in range(len(self.params)) if i not in covered]
        return [task for task in candidates if task is not None]

    def replacements(self, done: Sequence[ProbeTask]) -> list[ProbeTask]:
        """Another coordinate in the same tensor for every coordinate probe whose stencil crossed a kink."""
        replacements = []
        for task in done:
            if task.index is not None and task.result is not None and task.result.reason == "kink":
                replacement = self._coordinate_probe(task.kind, task.tensor)
                if replacement is not None:
                    replacements.append(replacement)
        return replacements

    def _relative_step(self, dtype: torch.dtype, direction: bool = True) -> float:  # along many coordinates, or one
        return relative_step(dtype, self.native_dtype, direction=direction)

    def _tensor_scale(self, i: int) -> float:
        """The magnitude the steps in parameter ``i`` are relative to; the model's when the tensor is all zeros."""
        return max(self.param_rms[i], self.param_scale) or 1.0

    def _descent(self) -> ProbeTask | None:
        if not self.params or self.grad_norm == 0.0:
            return None
        direction = VectorDirection(
            [p for _, p in self.params], self.grads, self.grads, 1.0 / self.grad_norm, components_norm=self.grad_norm
        )
        # the step's scale along ĝ: each tensor's own magnitude, weighted by its share of the gradient
        weighted = sum(
            self._tensor_scale(i) ** 2 * (share / self.grad_norm) ** 2 for i, share in enumerate(self.tensor_grad_norms)
        )
        dtype = max((p.dtype for _, p in self.params), key=machine_epsilon)
        step = self._relative_step(dtype) * math.sqrt(weighted)
        moves = tuple(range(len(self.params)))
        return ProbeTask(
            ProbeKind.DESCENT, DESCENT_TARGET, None, direction, step, scale_floor=self.loss_floor, moves=moves
        )

    def _cover_probe(self, group: CoverGroup) -> ProbeTask:
        """Along ``d = Σ_T w_T g_T`` over the group's tensors (:mod:`.cover`), judged against their contributions' size
        rather than its balanced slope."""
        tensors = list(group.tensors)
        direction = VectorDirection(
            [self.params[i][1] for i in tensors],
            [self.grads[i] for i in tensors],
            [self.grads[i] for i in tensors],
            1.0 / group.norm,
            weights=group.weights,
        )
        shares = [abs(w) * self.tensor_grad_norms[i] / group.norm for i, w in zip(tensors, group.weights, strict=True)]
        weighted = sum(self._tensor_scale(i) ** 2 * share**2 for i, share in zip(tensors, shares, strict=True))
        dtype = max((self.params[i][1].dtype for i in tensors), key=machine_epsilon)
        step = self._relative_step(dtype) * math.sqrt(weighted)
        floor = max(group.contributions / group.norm, self.loss_floor)
        return ProbeTask(ProbeKind.COVER, DESCENT_TARGET, None, direction, step, floor, moves=tuple(tensors))

    def _random_anchor(self) -> ProbeTask | None:
        """A random unit direction over every parameter, for a gradient that is exactly zero."""
        if not self.params:
            return None
        generator = _shard_generator(self.rng.getrandbits(63))
        vectors = [torch.randn(p.shape, generator=generator, dtype=torch.float64) for _, p in self.params]
        for i, mask in self.exempt.items():
            vectors[i][mask.cpu()] = 0.0
        size = norm(vectors) or 1.0
        components = [v.to(device=p.device, dtype=p.dtype) for v, (_, p) in zip(vectors, self.params, strict=True)]
        direction = VectorDirection([p for _, p in self.params], components, self.grads, 1.0 / size)
        dtype = max((p.dtype for _, p in self.params), key=machine_epsilon)
        step = self._relative_step(dtype) * (self.param_scale or 1.0)
        floor = self.loss_floor
        moves = tuple(range(len(self.params)))
        return ProbeTask(
            ProbeKind.RANDOM, DESCENT_TARGET, None, direction, step, scale_floor=floor, missing=True, moves=moves
        )

    def _input_direction(self) -> ProbeTask | None:
        grads = self.reference.input_grads
        nonzero = any_rank([bool(g.any()) for g in grads.values()])
        paths = [path for path, moved in zip(grads, nonzero, strict=True) if moved]
        if not paths or self.settings.probes.input_probes == 0:
            return None
        tensors = [self.evaluator.inputs[path] for path in paths]
        components = [grads[path] for path in paths]
        size = norm(components)
        direction = VectorDirection(tensors, components, components, 1.0 / size,
                                    after_write=self.evaluator.mark_inputs_current)  # fmt: skip
        step = self._relative_step(tensors[0].dtype) * (rms(*tensors) or 1.0)
        target = paths[0] if len(paths) == 1 else ROOT  # "batch": all its floating tensors
        return ProbeTask(ProbeKind.INPUT, target, None, direction, step, scale_floor=0.0, moves=tuple(paths))

    def _tensor_probe(self, i: int) -> ProbeTask | None:
        name, param = self.params[i]
        grad = self.grads[i]
        size = self.tensor_grad_norms[i]
        if size == 0.0:
            return None
        direction = VectorDirection([param], [grad], [grad], 1.0 / size, components_norm=size)
        step = self._relative_step(param.dtype) * self._tensor_scale(i)
        floor = max(self.negligible * self.grad_norm, self.loss_floor)
        return ProbeTask(ProbeKind.TENSOR, name, None, direction, step, scale_floor=floor, tensor=i, moves=(i,))

    def _random_probe(self, i: int) -> ProbeTask:
        name, param = self.params[i]
        grad = self.grads[i]
        generator = _shard_generator(self.rng.getrandbits(63))
        vector = torch.randn(param.shape, generator=generator, dtype=torch.float64)
        if i in self.exempt:
            vector[self.exempt[i].cpu()] = 0.0
        vector = vector.div_(norm([vector]) or 1.0).to(device=param.device, dtype=param.dtype)
        direction = VectorDirection([param], [vector], [grad])
        step = self._relative_step(param.dtype) * self._tensor_scale(i)
        # |r·g| is about ‖g_T‖/√n for a random unit r; a tensor without gradient is compared with the whole model's
        expected = max(self.tensor_grad_norms[i], self.negligible * self.grad_norm)
        floor = expected / math.sqrt(max(self.numels[i], 1))
        return ProbeTask(
            ProbeKind.RANDOM, name, None, direction, step, floor, tensor=i, missing=self.missing[i], moves=(i,)
        )

    def _coordinate_probe(self, kind: ProbeKind, tensor: int, index: tuple[int, ...] | None = None) -> ProbeTask | None:
        if kind.traits.moves_inputs:
            return self._input_coordinate(tensor, index)
        name, param = self.params[tensor]
        shape = global_shape(param)
        if index is None:
            index = _random_index(shape, self.rng)
        for _ in range(8):  # a coordinate whose gradient is zero by design says nothing: another one
            if tensor not in self.exempt or not value_at(self.exempt[tensor], index):
                break
            index = _random_index(shape, self.rng)
        else:
            return None
        grad = self.grads[tensor]
        direction = CoordinateDirection(param, index, value_at(grad, index))
        step = self._relative_step(param.dtype, direction=False) * max(direction.magnitude, self._tensor_scale(tensor))
        numel = self.numels[tensor]
        grad_rms = self.tensor_grad_norms[tensor] / math.sqrt(max(numel, 1))
        floor = max(2 * grad_rms, self.negligible * self.grad_norm / math.sqrt(numel))
        missing = self.missing[tensor]
        return ProbeTask(
            ProbeKind.PARAM, name, index, direction, step, floor, tensor=tensor, missing=missing, moves=(tensor,)
        )

    def _input_coordinates(self) -> list[ProbeTask | None]:
        if active() is not None:  # each rank's inputs differ in shape and number: only the input direction is global
            return []
        grads = self.reference.input_grads
        inputs = [self.evaluator.inputs[path] for path in grads]
        coordinates = sample_coordinates(
            [tuple(x.shape) for x in inputs], self.settings.probes.input_probes - 1, self.rng, self.settings.rotation
        )
        return [self._input_coordinate(c.tensor, c.index) for c in coordinates]

    def _input_coordinate(self, tensor: int, index: tuple[int, ...] | None) -> ProbeTask | None:
        grads = self.reference.input_grads
        path = list(grads)[tensor]
        working = self.evaluator.inputs[path]
        if index is None:
            index = _random_index(working.shape, self.rng)
        grad = grads[path]
        direction = CoordinateDirection(working, index, grad[index].item(), self.evaluator.mark_inputs_current)
        relative = self._relative_step(working.dtype, direction=False)
        step = relative * (max(direction.value.abs().item(), rms(working)) or 1.0)
        floor = 2 * rms(grad)
        return ProbeTask(ProbeKind.INPUT, path, index, direction, step, scale_floor=floor, tensor=tensor, moves=(path,))


def _shard_generator(seed: int) -> torch.Generator:
    """A generator for a random direction: in a sharded check each rank draws its own shard of the direction."""
    collective = active()
    if collective is not None:
        seed = random.Random(f"{seed}:{collective.rank}").getrandbits(63)
    return torch.Generator().manual_seed(seed)


def _random_index(shape: torch.Size, rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(size) for size in shape)
