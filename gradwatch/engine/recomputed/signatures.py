"""Gradients that are deliberately not the derivative, told by their signature in a check's probes.

* a **straight-through estimator** (a fake quantiser ``w + (round(w) - w).detach()``, ``sign`` with an identity
  backward): the loss is piecewise constant in the tensor, so every probe of it reads a flat loss while autograd gives
  it a gradient; at a coarse step (:data:`COARSE_STEP` of the tensor's size) the loss moves. A gradient for a tensor
  the loss does not depend on at all is no estimator but a bug, and stays one.
* a **stop-gradient** (``.detach()``, ``torch.no_grad()``, an integer cast on the tensor's path; a target network, a
  frozen branch): autograd gives the tensor no gradient along every direction probed while the loss moves with it. An
  accidental detach looks the same, so these probes still fail.

:func:`straight_through` and :func:`stop_gradients` find them. The probes of a straight-through tensor end
inconclusive with reason ``"surrogate"``, and so does the descent probe when its failure is exactly those tensors'
share of the predicted decrease (``‖g_T‖² / ‖g‖``). Each finding is said in words, with the ``ignore=`` pattern that
exempts the tensors (:func:`ignore_patterns`), in the report's ``surrogates`` and failure messages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.measuring.directions import VectorDirection
from gradwatch.engine.measuring.points import measure
from gradwatch.engine.numerics.assessment import SIGNIFICANCE
from gradwatch.engine.numerics.norms import norm
from gradwatch.engine.numerics.steps import machine_epsilon
from gradwatch.engine.probing.portfolio import Portfolio
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.results.kinds import ProbeKind

COARSE_STEP = 0.1
"""How far the coarse probe of a flat tensor moves it: this fraction of its RMS per element, on average. Far enough to
cross the steps of any quantiser that trains (a step larger than the weights' own spread would quantise them all to
the same value); a loss that still does not move does not depend on the tensor."""

MOVED = 1e-3
"""The coarse probe's loss change, relative to the change the gradient predicts, above which the loss moves with the
tensor (a piecewise-constant function: a straight-through estimator)."""

ROUNDING = 64
"""A coarse probe's loss change must exceed this many ulps of the loss in the parameter's dtype to count as a move: a
loss that truly does not depend on the tensor (a bias before BatchNorm) still moves by its rounding."""


def straight_through(
    evaluator: LossEvaluator, portfolio: Portfolio, tasks: Sequence[ProbeTask], rtol: float
) -> list[str]:
    """Find the straight-through estimators among the ``tasks`` measured at the checked point (before any failure is
    confirmed elsewhere), mark the probes they explain ``"surrogate"``, and say what was found (see the module doc).
    ``evaluator`` must be on the native parameters."""
    by_tensor = _by_tensor(tasks)
    flat = [
        i
        for i, probes in by_tensor.items()
        if all(_flat(task) for task in probes) and any(task.result.verdict != "ok" for task in probes if task.result)
    ]
    found = [i for i in flat if _moves_coarsely(evaluator, portfolio, i)]
    if not found:
        return []
    for i in found:
        for task in by_tensor[i]:
            task.mark("inconclusive", "surrogate")
    _explain_descent(tasks, portfolio, found, rtol)
    names = [name for name, _ in evaluator.params]
    tensors = [names[i] for i in found]
    return [
        f"straight-through estimator: the loss is piecewise constant in {_listed(tensors)} (flat at every probe, "
        f"moving at a coarse step) while autograd gives {_them(tensors)} a gradient; {_them(tensors)} cannot be "
        f"checked. To skip {_them(tensors)}: ignore={ignore_patterns(tensors, names)!r}"
    ]


def stop_gradients(evaluator: LossEvaluator, tasks: Sequence[ProbeTask]) -> list[str]:
    """Say which tensors the finished ``tasks`` show stopped (see the module doc); their probes still fail."""
    names = [name for name, _ in evaluator.params]
    tensors = [
        names[i]
        for i, probes in _by_tensor(tasks).items()
        if all(task.failed and (task.missing or task.direction.analytic == 0.0) for task in probes)
    ]
    if not tensors:
        return []
    return [
        f"stop-gradient: autograd gives {_listed(tensors)} no gradient, but the loss depends on {_them(tensors)} (a "
        ".detach(), torch.no_grad() or integer cast on the path). If that is deliberate (a target network, a frozen "
        f"branch), skip {_them(tensors)}: ignore={ignore_patterns(tensors, names)!r}"
    ]


def _by_tensor(tasks: Sequence[ProbeTask]) -> dict[int, list[ProbeTask]]:
    """The measured probes of each parameter tensor (along its gradient, a random direction or a coordinate)."""
    by_tensor: dict[int, list[ProbeTask]] = {}
    for task in tasks:
        if task.kind.traits.one_tensor and task.tensor >= 0 and task.result is not None:
            by_tensor.setdefault(task.tensor, []).append(task)
    return by_tensor


def _flat(task: ProbeTask) -> bool:
    """Whether the probe measured no slope (zero, or within its noise: float64 reductions leave an ulp) where autograd
    gives one, or agreed with a slope that is itself negligible."""
    result = task.result
    assert result is not None
    if result.verdict == "ok":
        return abs(result.numeric) <= SIGNIFICANCE * result.noise or result.numeric == 0.0
    if result.reason == "flat":
        return task.direction.analytic != 0.0
    return (
        abs(result.numeric) <= SIGNIFICANCE * result.noise
        and abs(task.direction.analytic) > SIGNIFICANCE * result.noise
    )


def _moves_coarsely(evaluator: LossEvaluator, portfolio: Portfolio, i: int) -> bool:
    """Whether the loss moves when tensor ``i`` moves by :data:`COARSE_STEP` of its RMS along its gradient."""
    param = evaluator.params[i][1]
    grad = portfolio.grads[i]
    grad_norm = portfolio.tensor_grad_norms[i]
    size = norm([param])
    if grad_norm == 0.0 or size == 0.0:
        return False
    direction = VectorDirection([param], [grad], [grad], 1.0 / grad_norm, components_norm=grad_norm)
    step = COARSE_STEP * size
    plus, minus = measure(evaluator, direction, step, (1.0, -1.0))
    change = abs(plus.value - minus.value)
    predicted = abs(plus.predicted - minus.predicted)
    rounding = ROUNDING * machine_epsilon(param.dtype) * abs(portfolio.reference.loss)
    return math.isfinite(change) and change > max(MOVED * predicted, rounding)


def _explain_descent(tasks: Sequence[ProbeTask], portfolio: Portfolio, tensors: Sequence[int], rtol: float) -> None:
    """Mark the failing descent probe inconclusive if the straight-through tensors' share of its predicted decrease
    is all it is missing."""
    descent = next((task for task in tasks if task.kind == ProbeKind.DESCENT), None)
    if descent is None or not descent.failed or descent.result is None:
        return
    slope = descent.direction.analytic
    share = sum(portfolio.tensor_grad_norms[i] ** 2 for i in tensors) / slope if slope else 0.0
    result = descent.result
    if abs(result.numeric - (slope - share)) <= max(SIGNIFICANCE * result.noise, rtol * result.scale):
        descent.mark("inconclusive", "surrogate")


def ignore_patterns(tensors: Sequence[str], names: Sequence[str]) -> list[str]:
    """The fewest ``fnmatch`` patterns that match ``tensors`` and no other of ``names``: ``"quant.*"`` for every
    parameter of a module, the names themselves otherwise."""
    chosen = set(tensors)
    patterns: list[str] = []
    covered: set[str] = set()
    for tensor in tensors:
        if tensor in covered:
            continue
        best = tensor
        parts = tensor.split(".")
        for depth in range(1, len(parts)):
            prefix = ".".join(parts[:depth]) + "."
            inside = [name for name in names if name.startswith(prefix)]
            if inside and all(name in chosen for name in inside):
                best = prefix + "*"
                covered.update(inside)
                break
        covered.add(tensor)
        if best not in patterns:
            patterns.append(best)
    return patterns


def _listed(tensors: Sequence[str]) -> str:
    return ", ".join(tensors[:6]) + (f" and {len(tensors) - 6} more" if len(tensors) > 6 else "")


def _them(tensors: Sequence[str]) -> str:
    return "it" if len(tensors) == 1 else "them"
