"""Evaluating the loss at many points of a check in one forward pass.

Most points of a healthy check are the two points of a screen that moves a single parameter tensor (the tensor, random
and coordinate probes). On the small probe batches checks use, one evaluation is largely fixed cost: operator dispatch
on a CPU, kernel launches on a GPU, dropout's random draws. :class:`VectorizedLoss` stacks each tensor those points
move, one copy per point along a new leading dimension, and evaluates the points at once with ``torch.func.vmap`` (see
:meth:`~gradwatch.engine.function.evaluation.LossEvaluator.losses`): one pass, one set of random draws, batched kernels,
and the layers before the first moved tensor computed once for all points.

Points that move every parameter (the descent probe's) or the inputs batch the whole network, so they get passes of
their own: in one pass with the screens, they made the CNN of the overhead benchmark's checks 1.5x slower on a CPU; in
a pass of their own, its checks and the GPT's are 5-10% faster than with those points evaluated one by one.

Points are vectorised only where that computes what point-by-point evaluation computes:

* on float64 probes, where the batched kernels' different rounding (~1e-16 of the loss) is far below anything a probe
  resolves; native float32 probes are evaluated one by one;
* once the first pass has reproduced the loss at the unperturbed point, evaluated on its own beforehand, to within
  :data:`AGREEMENT`: same dropout masks, same function.

A loss that vmap cannot run (``.item()``, control flow on tensor values, a custom ``autograd.Function`` without a vmap
rule, an in-place update of a module's state) or that does not reproduce is evaluated point by point for the rest of
the check, with a note that says why; so is a model with forward hooks, which would see the batched tensors. The memory
a pass may take is bounded (:func:`memory_budget`); points beyond it go to further passes, or are evaluated one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.measuring.directions import CoordinateDirection, Displacement, VectorDirection
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.errors import passes_fallbacks

AGREEMENT = 1e-11
"""How closely, relative to the loss, a pass must reproduce the loss at the unperturbed point evaluated on its own:
different random draws or a different function miss by far more, different rounding of batched kernels by ~1e-16."""

MAX_POINTS = 32
"""Points per pass; more amortise no more overhead."""

MIN_POINTS = 4
"""Fewer points are evaluated one by one: a pass of two barely amortises its stacking."""

SPLIT_ACTIVATIONS = 2**20
"""The activations per point (bytes, float64) from which the one-tensor screens are split in two passes (see
:meth:`VectorizedLoss._halves`): below it a pass's fixed cost outweighs the batched layers the split saves."""

MEMORY = 2**28
"""The least memory a pass may take, in bytes (256 MiB); see :func:`memory_budget`."""

Move = tuple[CoordinateDirection | VectorDirection, float]
"""A point of a vectorised pass: a direction that writes stacked rows (hooked directions are evaluated one by one)
and the offset along it."""


def memory_budget(params: Sequence[Tensor]) -> int:
    """The memory one pass may take (its stacked tensors plus every point's activations): :data:`MEMORY`, or as much
    as a float64 copy of the parameters (which the float64 probes hold anyway) if that is more."""
    return max(MEMORY, 8 * sum(p.numel() for p in params))


class VectorizedLoss:
    """Evaluates the loss at many points in few forward passes, or says it cannot.

    Args:
        evaluator: The check's evaluator, on float64 storage; its parameters and inputs are the tensors points move.
        center: The loss at the unperturbed point, evaluated on its own: the first pass must reproduce it.
        memory: The bytes one pass may take.
    """

    def __init__(self, evaluator: LossEvaluator, center: float, memory: int) -> None:
        self.evaluator = evaluator
        self.center = center
        self.memory = memory
        self.usable = True
        """False once a pass failed or did not reproduce the centre: the rest of the check evaluates point by point."""
        self._validated = False  # a pass has reproduced the centre
        self._names = {id(p): name for name, p in evaluator.params}
        self._positions = {id(p): position for position, (_, p) in enumerate(evaluator.params)}
        self._paths = {id(t): path for path, t in evaluator.inputs.items()}
        self._activations = 8 * evaluator.saved_elements  # per point: one evaluation's activations, in float64

    @property
    def outcome(self) -> bool | None:
        """``True`` once points were evaluated in a pass, ``False`` if the loss could not be vectorised, ``None`` if no
        pass was made (no group of points fitted)."""
        if not self.usable:
            return False
        return True if self._validated else None

    def evaluate(self, moves: Sequence[Move]) -> list[tuple[float, Displacement] | None]:
        """The loss and the displacement at each point; ``None`` for the points left to be evaluated one by one (see
        :meth:`_passes`), and for all of them once :attr:`usable` is false."""
        results: list[tuple[float, Displacement] | None] = [None] * len(moves)
        if not self.usable:
            return results
        for group in self._passes(moves):
            values = self._pass([moves[i] for i in group])
            if values is None:  # the pass gave up: the rest of the check goes point by point
                break
            for i, value in zip(group, values, strict=True):
                results[i] = value
        return results

    def _passes(self, moves: Sequence[Move]) -> list[list[int]]:
        """The points in passes that fit the memory budget: those that move the whole network (several parameter
        tensors, or an input) apart from those that move one parameter tensor, which then batch only the layers from
        that tensor on; the latter in the order of the parameters, split in two (:meth:`_halves`) from
        :data:`SPLIT_ACTIVATIONS`. Points that fit no pass, and passes of fewer than :data:`MIN_POINTS`, are left out.
        """
        whole: list[int] = []
        single: list[int] = []
        for i, (direction, _) in enumerate(moves):
            keys = [id(t) for t in direction.tensors]
            if len(keys) == 1 and keys[0] in self._names:
                single.append(i)
            elif all(key in self._names or key in self._paths for key in keys):
                whole.append(i)
        single.sort(key=lambda i: self._positions[id(moves[i][0].tensors[0])])
        passes = self._fill(whole, moves)
        for group in self._fill(single, moves):
            passes += self._halves(group, moves) if self._activations >= SPLIT_ACTIVATIONS else [group]
        return [group for group in passes if len(group) >= MIN_POINTS]

    def _halves(self, group: list[int], moves: Sequence[Move]) -> list[list[int]]:
        """One-tensor points, in the order of their tensors, as two passes split between two tensors near the middle
        (one pass if a half would have fewer than :data:`MIN_POINTS`), so that the later batches fewer layers. On the
        overhead benchmark's models (16 points, CPU, 2.5 and 8 MB of float64 activations per point) a check took 27.6
        and 58.4 ms in one pass, 23.7 and 57.5 ms in two, more in three or four (each pass's fixed costs outweigh what
        it saves); the detection benchmark's (0.06-0.3 MB per point) lost up to 1.3 ms: hence :data:`SPLIT_ACTIVATIONS`.
        """
        positions = [self._positions[id(moves[i][0].tensors[0])] for i in group]
        cuts = [
            k
            for k in range(MIN_POINTS, len(group) - MIN_POINTS + 1)
            if positions[k] != positions[k - 1]  # a tensor's points stay in one pass
        ]
        if not cuts:
            return [group]
        cut = min(cuts, key=lambda k: abs(2 * k - len(group)))
        return [group[:cut], group[cut:]]

    def _fill(self, order: Sequence[int], moves: Sequence[Move]) -> list[list[int]]:
        """Points in ``order`` into consecutive passes, each as large as the budget allows."""
        passes: list[list[int]] = []
        group: list[int] = []
        touched: dict[int, int] = {}  # id → elements of each tensor the group's points move
        for i in order:
            mine = {id(t): t.numel() for t in moves[i][0].tensors}
            if group and not self._fits(len(group) + 1, {**touched, **mine}):
                passes.append(group)
                group, touched = [], {}
            if self._fits(len(group) + 1, {**touched, **mine}):
                group.append(i)
                touched.update(mine)
        return [*passes, group] if group else passes

    def _fits(self, points: int, touched: dict[int, int]) -> bool:
        points += not self._validated  # the first pass also evaluates the centre
        if points > MAX_POINTS:
            return False
        return points * (8 * sum(touched.values()) + self._activations) <= self.memory

    def _pass(self, moves: Sequence[Move]) -> list[tuple[float, Displacement]] | None:
        validate = not self._validated
        points = len(moves) + validate
        stacks, displacements = _stacks(moves, first_slot=int(validate))  # slot 0: the unperturbed point
        params = {self._names[key]: stack for key, stack in stacks.items() if key in self._names}
        inputs = {self._paths[key]: stack for key, stack in stacks.items() if key in self._paths}
        try:
            values = self.evaluator.losses(params, inputs, points)
        except Exception as error:  # anything vmap cannot run is evaluated point by point instead
            if passes_fallbacks(error):
                raise
            first_line = (str(error).strip().splitlines() or [""])[0]  # vmap's messages run on with advice and links
            self._give_up(
                NoteCode.NOT_VECTORISABLE, f"the loss cannot be vectorised ({type(error).__name__}: {first_line})"
            )
            return None
        if validate:
            center, values = values[0], values[1:]
            if not abs(center - self.center) <= AGREEMENT * abs(self.center):
                self._give_up(
                    NoteCode.VECTORISED_MISMATCH,
                    f"a vectorised pass gave {center!r} at the unperturbed point, {self.center!r} on its own",
                )
                return None
            self._validated = True
        return list(zip(values, displacements, strict=True))

    def _give_up(self, code: NoteCode, reason: str) -> None:
        self.usable = False
        self.evaluator.notes.append(Note(code, f"points evaluated one by one: {reason}"))


def _stacks(moves: Sequence[Move], first_slot: int) -> tuple[dict[int, Tensor], list[Displacement]]:
    """Each tensor the points move, stacked along a new leading dimension with one row per point from ``first_slot``
    on (the other rows hold its own values), and each point's displacement. Consecutive points of one direction write
    their rows in one operation per tensor; only rows no direction writes whole are filled with copies."""
    # (direction, offsets, first row) of consecutive points
    runs: list[tuple[CoordinateDirection | VectorDirection, list[float], int]] = []
    for slot, (direction, offset) in enumerate(moves, start=first_slot):
        if runs and runs[-1][0] is direction and runs[-1][2] + len(runs[-1][1]) == slot:
            runs[-1][1].append(offset)
        else:
            runs.append((direction, [offset], slot))
    tensors = {id(t): t.detach() for direction, _ in moves for t in direction.tensors}
    written: dict[int, list[tuple[int, int]]] = {key: [] for key in tensors}
    for direction, offsets, start in runs:
        if direction.writes_whole_rows:
            for t in direction.tensors:
                written[id(t)].append((start, start + len(offsets)))
    points = first_slot + len(moves)
    stacks = {}
    for key, t in tensors.items():
        stack = t.new_empty((points, *t.shape))
        filled = 0
        for start, stop in [*sorted(written[key]), (points, points)]:
            if start > filled:
                stack[filled:start].copy_(t.expand(start - filled, *t.shape))
            filled = max(filled, stop)
        stacks[key] = stack
    displacements: list[Displacement] = []
    for direction, offsets, start in runs:
        rows = {id(t): stacks[id(t)][start : start + len(offsets)] for t in direction.tensors}
        displacements += direction.displace_rows(offsets, rows)
    return stacks, displacements


def obstacle(evaluator: LossEvaluator) -> Note | None:
    """Why the evaluator's points cannot be evaluated together, or ``None`` if they can: every parameter and input
    it moves must be float64, and no forward hook may see the pass (it would get, and might keep, the batched tensors
    of all points instead of one point's activations)."""
    tensors = [p for _, p in evaluator.params] + list(evaluator.inputs.values())
    if not tensors or any(t.dtype != torch.float64 for t in tensors):
        return Note(NoteCode.NOT_FLOAT64_UNVECTORISED, "the probes are not float64")
    hooked = [name or "the model" for name, module in evaluator.model.named_modules() if _forward_hooks(module)]
    if _forward_hooks(None):
        hooked.insert(0, "every module (global hooks)")
    if hooked:
        listed = f"{', '.join(hooked[:3])}{', ...' if len(hooked) > 3 else ''}"
        return Note(NoteCode.HOOKS_UNVECTORISED, f"forward hooks on {listed} would see vectorised passes")
    if evaluator.data_dependent is not None:  # known from the reference pass: spare a pass that would fail
        return Note(
            NoteCode.NOT_VECTORISABLE,
            f"the loss cannot be vectorised (it calls {evaluator.data_dependent} on a value computed from the "
            "parameters)",
        )
    if evaluator.refused_function is not None:
        return Note(
            NoteCode.NOT_VECTORISABLE,
            f"the loss cannot be vectorised (its autograd.Function {evaluator.refused_function} has no vmap rule)",
        )
    return None


def _forward_hooks(module: nn.Module | None) -> bool:
    """Whether ``module`` has forward or forward-pre hooks (``None``: whether global ones are registered)."""
    if module is None:
        return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)
    return bool(module._forward_hooks or module._forward_pre_hooks)
