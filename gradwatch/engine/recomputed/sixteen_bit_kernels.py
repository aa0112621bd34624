"""The backward of a 16-bit kernel that refuses float64, checked on its own module in its own precision.

A pure-16-bit model (``model.to(torch.bfloat16)``, no autocast) is probed in float64 so that finite differences
resolve its gradient to its rounding (:mod:`.sixteen_bit_floor`). A fused kernel that accepts only 16-bit inputs (a
bf16-only RMSNorm, flash attention) makes the float64 loss raise, and the probes then run in bfloat16, where the
model's loss is resolved to about 1% at best and its tolerance is the fixed 0.1: a 5% bug in such a kernel's input
gradient, diluted to 1.7% in the gradient of the parameters below it, passed three checks.

The kernel's own module, alone, is resolved far better: its error is undiluted, and a finite difference of
``⟨ḡ, M(x)⟩`` (``ḡ`` the gradient its output received in the reference pass) rounds only the module's output, each
element once, with errors that mostly cancel in the sum. So each module of the refusing class that the loss runs is
checked at its first call's native inputs: the directional derivative
of ``⟨ḡ, M(x)⟩`` along the gradient the module's backward passed to its floating inputs (a ``"module_input"`` probe)
and along the one it gave its own parameters (``"module_params"``), against a Richardson-extrapolated central
difference at :data:`STEP` (and again at :data:`CONFIRMATION` of it), the displaced points rounded to the module's
dtype and the analytic side taken along the displacement actually made. The tolerance is :data:`FLOOR_MULTIPLE` times
the rounding of a 16-bit gradient along its own direction (half a unit in the last place: Cauchy-Schwarz), above the
finite difference's own round-off (the output's rounding, ``ε / √12`` per element, propagated). A failure names the
module: its backward disagrees with its own forward.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.function.sixteen_bit import SIXTEEN_BIT
from gradwatch.engine.numerics.assessment import RESOLUTION, SIGNIFICANCE
from gradwatch.engine.recomputed.sixteen_bit_floor import FLOOR_MULTIPLE
from gradwatch.engine.results.kinds import ProbeKind, Reason, Verdict
from gradwatch.engine.results.naming import named_module
from gradwatch.engine.results.report import Probe

STEP = 0.1
"""The first central difference's step, relative to the norm of the displaced tensors: the finite difference's round-off
(about ``ε / (√12 · h)`` of the module's output rounding, most of it cancelling) and a Richardson extrapolation's
truncation (``O(h⁴)``) both well below 1% on a bf16 RMSNorm, whose errors at a single central difference were 0.1-0.6%
at ``h = 0.03``, 1-2% (truncation) at 0.1 and up to 3% (round-off) at 0.003."""

CONFIRMATION = 0.7
"""The second measurement's step, relative to the first: a verdict stands only where the two agree within their
round-off (a Richardson extrapolation's truncation, ``O(h⁴)``, differs fourfold between them; a bug does not)."""

SMALLER = 3.0
"""Where the two measurements disagree (truncation: a fused MLP's weights moved 10% at once), the step is this many
times smaller, at most :data:`LEVELS` steps in all."""

LEVELS = 3

MOST_MODULES = 8
"""The most modules of the refusing class one check measures (each: a backward and 16 forwards of the module per
step tried)."""


def kernel_probes(model: nn.Module, evaluator: LossEvaluator, kind: type[nn.Module]) -> list[Probe]:
    """The ``"module_input"`` and ``"module_params"`` probes of every module of class ``kind`` that the loss runs (at
    most :data:`MOST_MODULES`), on 16-bit inputs, at the evaluator's (native) point (see the module doc)."""
    names = {id(m): n for n, m in model.named_modules() if type(m) is kind}
    calls: dict[int, tuple[nn.Module, tuple[Any, ...], dict[str, Any], Tensor]] = {}

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if id(module) in names and id(module) not in calls and isinstance(output, Tensor) and output.requires_grad:
            kept = tuple(a.detach().clone() if isinstance(a, Tensor) else a for a in args)
            calls[id(module)] = (module, kept, kwargs, output)

    handles = [m.register_forward_hook(record, with_kwargs=True) for m in model.modules() if id(m) in names]
    try:
        _, grads = evaluator.gradients_wrt(lambda: [call[3] for call in calls.values()])
    finally:
        for handle in handles:
            handle.remove()
    probes = []
    for (module, args, kwargs, _), upstream in list(zip(calls.values(), grads, strict=True))[:MOST_MODULES]:
        if upstream is not None:
            probes += _module_probes(names[id(module)], module, args, kwargs, upstream.detach())
    return probes


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call of a module as the reference pass made it: its arguments, the gradient its output received, and the
    positions of its 16-bit floating arguments (what a ``"module_input"`` probe moves)."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    upstream: Tensor
    inputs: list[int]

    def output(self, moved: Sequence[Tensor] | None = None, params: Sequence[tuple[Tensor, Tensor]] = ()) -> Tensor:
        """The module's output with its 16-bit arguments replaced by ``moved`` and each ``(parameter, value)`` of
        ``params`` holding the value (put back after), its random draws the same at every call."""
        called = list(self.args)
        for i, tensor in zip(self.inputs, moved if moved is not None else [], strict=False):
            called[i] = tensor
        saved = [p.detach().clone() for p, _ in params]
        try:
            for p, value in params:
                p.data.copy_(value)
            with torch.random.fork_rng():  # dropout inside a kernel draws one mask for every evaluation
                torch.manual_seed(0)
                return self.module(*called, **self.kwargs)
        finally:
            for (p, _), value in zip(params, saved, strict=True):
                p.data.copy_(value)


def _module_probes(name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   upstream: Tensor) -> list[Probe]:  # fmt: skip
    inputs = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.dtype in SIXTEEN_BIT]
    params = [p for p in module.parameters() if p.requires_grad and p.dtype in SIXTEEN_BIT]
    if not inputs:
        return []
    call = _Call(module, args, kwargs, upstream, inputs)
    with torch.enable_grad():
        moving = [args[i].detach().requires_grad_(True) for i in inputs]
        found = torch.autograd.grad(call.output(moving), [*moving, *params], upstream, allow_unused=True)
    analytic = [torch.zeros_like(t) if g is None else g for t, g in zip([*moving, *params], found, strict=True)]
    probes = []
    for kind, tensors, slopes in (
        (ProbeKind.MODULE_INPUT, [args[i] for i in inputs], analytic[: len(inputs)]),
        (ProbeKind.MODULE_PARAMS, params, analytic[len(inputs) :]),
    ):
        if tensors and any(bool(s.any()) for s in slopes):
            probes.append(_probe(kind, name, call, tensors, slopes))
    return probes


def _probe(kind: ProbeKind, name: str, call: _Call, tensors: Sequence[Tensor], slopes: Sequence[Tensor]) -> Probe:
    """One probe of the module along ``slopes`` (its backward's gradient in ``tensors``), measured at two steps, from
    :data:`STEP` down until they agree."""
    size = math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))
    length = math.sqrt(sum(float(s.double().pow(2).sum()) for s in slopes))
    epsilon = float(torch.finfo(tensors[0].dtype).eps)
    tolerance = FLOOR_MULTIPLE * epsilon / 2  # a 16-bit gradient's rounding along its own direction, at most
    for level in range(LEVELS):  # down from STEP until the two measurements agree (truncation gone)
        step = STEP / SMALLER**level
        measured = [_extrapolated(call, kind == ProbeKind.MODULE_INPUT, tensors, slopes, step * size / length * f)
                    for f in (1.0, CONFIRMATION)]  # fmt: skip
        errors = [ratio - 1 for ratio, _ in measured]
        noises = [noise for _, noise in measured]
        consistent = abs(errors[0] - errors[1]) <= SIGNIFICANCE * math.hypot(*noises)
        if consistent:
            break
    beyond = [abs(e) > tolerance + SIGNIFICANCE * n for e, n in zip(errors, noises, strict=True)]
    if consistent and all(beyond):
        verdict, reason = Verdict.FAIL, Reason("discrepancy")
    elif consistent and all(abs(e) <= tolerance and SIGNIFICANCE * n <= RESOLUTION
                            for e, n in zip(errors, noises, strict=True)):  # fmt: skip
        verdict, reason = Verdict.OK, Reason("agrees")
    else:
        verdict, reason = Verdict.INCONCLUSIVE, Reason("unresolved" if consistent else "unstable")
    error = min(errors, key=abs)
    return Probe(kind=kind, target=name, index=None, analytic=length, numeric=length * (1 + error),
                 rel_error=abs(error) / max(1 + error, 1.0), verdict=verdict, noise=length * max(noises),
                 step=step * size, reason=reason, evaluations=8 * (level + 1))  # fmt: skip


def _extrapolated(call: _Call, inputs: bool, tensors: Sequence[Tensor], slopes: Sequence[Tensor],
                  step: float) -> tuple[float, float]:  # fmt: skip
    """The ratio of the finite difference of ``⟨ḡ, M⟩`` to the analytic change along the displacement made (the
    displaced ``tensors`` rounded to their dtype), Richardson-extrapolated from steps ``step`` and ``2 step``, with its
    round-off (relative; ``nan`` and ``inf`` where the rounded displacement vanished)."""
    ratios, noises = [], []
    for h in (step, 2 * step):
        changes, analytic, rounding = [], 0.0, 0.0
        for sign in (1.0, -1.0):
            moved = [(t.detach().double() + sign * h * s.double()).to(t.dtype)
                     for t, s in zip(tensors, slopes, strict=True)]  # fmt: skip
            with torch.no_grad():
                output = call.output(moved) if inputs else call.output(params=list(zip(tensors, moved, strict=True)))
            weighted = call.upstream.double() * output.double()
            changes.append(float(weighted.sum()))
            rounding += float(torch.finfo(output.dtype).eps) ** 2 / 12 * float(weighted.pow(2).sum())
            analytic += sign * sum(float((s.double() * m.double()).sum()) for s, m in zip(slopes, moved, strict=True))
        if analytic == 0.0:
            return math.nan, math.inf
        ratios.append((changes[0] - changes[1]) / analytic)
        noises.append(math.sqrt(rounding) / abs(analytic))
    return (4 * ratios[0] - ratios[1]) / 3, math.hypot(4 * noises[0], noises[1]) / 3


def kernel_culprit(model: nn.Module, probes: Sequence[Probe]) -> tuple[list[str], str]:
    """The module whose failing probe of :func:`kernel_probes` proves its backward wrong, with the modules containing
    it, and the message; ``([], "")`` when none failed."""
    failing = [p for p in probes if p.kind in (ProbeKind.MODULE_INPUT, ProbeKind.MODULE_PARAMS) and p.verdict == "fail"]
    if not failing:
        return [], ""
    worst = max(failing, key=lambda p: p.rel_error)
    parts = worst.target.split(".")
    culprits = [worst.target] + [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]
    what = "input gradient" if worst.kind == ProbeKind.MODULE_INPUT else "parameters' gradient"
    named = named_module(worst.target, type(model.get_submodule(worst.target)).__name__)
    return culprits, (
        f"the backward of {named} is wrong: its {what} is {worst.rel_error:.1%} off (the module checked alone, in its "
        "own 16-bit precision: it refuses float64)"
    )
