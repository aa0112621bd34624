"""The gradient of a compiled model, as training computes it: compared with eager autograd's.

A check evaluates the loss on a slice of the batch, in float64, without autograd and under ``vmap``: through code
compiled with ``torch.compile`` each would compile a new graph, and a new shape can make the training's graph a
dynamic-shape one with slightly different numbers. So every evaluation of a check runs compiled code eagerly
(:func:`~gradwatch.engine.function.conditions.compiler_disabled`), and the probes check eager autograd's gradient.

That alone would hide a bug in a compiled backward. :func:`compiled_probes` computes the gradient on the whole batch
(the shapes training compiled for) once through the training's own compiled graph (refusing to recompile:
``torch.compiler.set_stance("fail_on_recompile")``) and once eagerly, under the same global settings, and compares
them tensor by tensor: a compiled gradient beyond the tolerance fails, as a ``"compiled"`` probe.

Cost: two forward and backward passes on the whole batch, about two training steps, per check of a compiled model.
When the compiled graph cannot be called without recompiling (mixed-precision autocast, a batch of another shape) or
computes another loss than eager code (inductor's dropout draws other masks), the comparison is skipped with a note.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch.engine.function.conditions import compiler_disabled
from gradwatch.engine.function.evaluation import LossFn, as_scalar_loss
from gradwatch.engine.function.state import TrainingState
from gradwatch.engine.numerics.norms import norms
from gradwatch.engine.numerics.steps import REPRODUCIBILITY_TOLERANCE, machine_epsilon
from gradwatch.engine.results.kinds import ProbeKind, Reason, Verdict
from gradwatch.engine.results.naming import named_module
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import DESCENT_TARGET, Probe
from gradwatch.errors import passes_fallbacks


def compiled_parts(model: nn.Module) -> list[str]:
    """The parts of ``model`` that ``torch.compile`` compiled: modules wrapped by it or compiled in place
    (``module.compile()``), and methods replaced by compiled ones (a LightningModule passed to ``Trainer.fit`` as
    ``torch.compile(module)``); ``[]`` for an eager model."""
    parts: list[str] = []
    for name, module in model.named_modules():
        label = name or type(module).__name__
        parts += [label] if _wrapped(module) else [f"{label}.{method}" for method in _compiled_methods(module)]
    return parts


def _wrapped(module: nn.Module) -> bool:
    """Whether ``torch.compile`` wraps ``module`` or compiled it in place."""
    return type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None


def _compiled_methods(module: nn.Module) -> list[str]:
    return [a for a, value in vars(module).items() if callable(value) and hasattr(value, "_torchdynamo_orig_callable")]


def compiled_culprit(model: nn.Module, probes: Sequence[Probe]) -> tuple[list[str], str]:
    """The compiled module whose compiled gradient differs from eager autograd's (failed ``"compiled"`` probes), with
    the modules containing it (``""`` for the model), and the message; ``([], "")`` when none failed. The compiled
    graph as a whole is named: the eager search cannot see into its code."""
    failing = [p for p in probes if p.kind == ProbeKind.COMPILED and p.verdict == "fail"]
    if not failing:
        return [], ""
    compiled = [name for name, module in model.named_modules() if _wrapped(module) or _compiled_methods(module)]
    # a wrong compiled backward makes the gradients upstream of it wrong too, outside the compiled module: the compiled
    # modules holding a failing tensor are the suspects, and their innermost common ancestor the culprit
    holding = [n for n in compiled if any(p.target.startswith(f"{n}.") or not n for p in failing)] or compiled
    if not holding:
        return [], ""
    name = _common_ancestor(holding)
    module = model.get_submodule(name)
    parts = name.split(".") if name else []
    culprits = [name] + [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]
    worst = max(failing, key=lambda p: p.rel_error)
    named = named_module(name, type(module).__name__)
    message = (
        f"the compiled backward of {named} is wrong: its compiled gradient differs from "
        f"eager autograd's ({worst.rel_error:.1%} on `{worst.target}`), and eager autograd's agrees with the loss"
        if not any(p.verdict == "fail" for p in probes if p.kind != ProbeKind.COMPILED)
        else f"the compiled backward of {named} differs from eager autograd's "
        f"({worst.rel_error:.1%} on `{worst.target}`)"
    )
    return culprits, message


def _common_ancestor(names: Sequence[str]) -> str:
    parts = [name.split(".") if name else [] for name in names]
    common: list[str] = []
    for level in zip(*parts, strict=False):  # as deep as the shallowest
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def compiled_probes(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    params: Sequence[tuple[str, Tensor]],
    state: TrainingState,
    rtol: float,
    *,
    notes: list[Note],
) -> list[Probe]:
    """The gradient training's compiled graph gives on ``batch`` compared with eager autograd's (see the module doc):
    one ``"compiled"`` probe per tensor whose compiled gradient is off, or one for the whole gradient when every tensor
    agrees; ``[]``, with a note, when the comparison could not be made."""
    if not hasattr(torch.compiler, "set_stance"):
        notes.append(Note(NoteCode.COMPILED_UNSUPPORTED, (
            "the compiled gradient was not compared with eager autograd's (needs torch >= 2.6)")))  # fmt: skip
        return []
    tensors = [p for _, p in params]
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            compiled_loss, compiled = _gradient(model, batch, loss_fn, tensors, state)
    except Exception as error:
        if passes_fallbacks(error):
            raise
        first_line = (str(error).strip().splitlines() or [""])[0]
        notes.append(Note(NoteCode.COMPILED_WOULD_RECOMPILE, (
            "the compiled gradient was not compared with eager autograd's: calling the training's compiled graph "
            f"on this batch would recompile it ({type(error).__name__}: {first_line})")))  # fmt: skip
        return []
    with compiler_disabled():
        eager_loss, eager = _gradient(model, batch, loss_fn, tensors, state)
    if abs(compiled_loss - eager_loss) > REPRODUCIBILITY_TOLERANCE * abs(eager_loss) + 1e-30:
        notes.append(Note(NoteCode.COMPILED_LOSS_DIFFERS, (
            "the compiled gradient was not compared with eager autograd's: the compiled loss "
            f"({compiled_loss:.9g}) is not the eager one ({eager_loss:.9g}), as with dropout, whose compiled masks "
            "differ from eager ones")))  # fmt: skip
        return []
    return _compare([name for name, _ in params], compiled, eager, rtol)


def _gradient(
    model: nn.Module, batch: Any, loss_fn: LossFn, tensors: list[Tensor], state: TrainingState
) -> tuple[float, list[Tensor]]:
    """The loss and its gradient, computed as training computes them (grad mode, the current global settings)."""
    completed = False
    state.before_evaluation()
    try:
        with torch.enable_grad():
            loss = as_scalar_loss(loss_fn(model, batch))
            grads = torch.autograd.grad(loss, tensors, allow_unused=True)
        completed = True
    finally:
        state.after_evaluation(completed)
    return float(loss.detach()), [
        g if g is not None else torch.zeros_like(t) for g, t in zip(grads, tensors, strict=True)
    ]


def _compare(names: list[str], compiled: list[Tensor], eager: list[Tensor], rtol: float) -> list[Probe]:
    """Per tensor, the relative difference ``‖g_c − g_e‖ / max(‖g_c‖, ‖g_e‖)``, floored like the other probes' scales;
    a tensor beyond ``rtol`` fails."""
    eager_norms = norms(eager, exact=True)
    compiled_norms = norms(compiled, exact=True)
    differences = norms([c.double() - e.double() for c, e in zip(compiled, eager, strict=True)], exact=True)
    total = math.hypot(*eager_norms)
    floor = machine_epsilon(eager[0].dtype if eager else torch.float32) ** (1 / 3) * total
    probes = []
    for name, c, e, difference in zip(names, compiled_norms, eager_norms, differences, strict=True):
        scale = max(c, e, floor)
        error = difference / scale if scale > 0 else 0.0
        if not math.isfinite(difference) or error > rtol:
            probes.append(_probe(name, c, e, error if math.isfinite(error) else math.inf, "fail", "discrepancy"))
    if probes:
        return probes
    error = math.hypot(*differences) / max(total, math.hypot(*compiled_norms), 1e-300)
    return [_probe(DESCENT_TARGET, math.hypot(*compiled_norms), total, error, "ok", "agrees")]


def _probe(target: str, compiled: float, eager: float, rel_error: float, verdict: str, reason: str) -> Probe:
    return Probe(
        kind=ProbeKind.COMPILED,
        target=target,
        index=None,
        analytic=compiled,
        numeric=eager,
        rel_error=rel_error,
        verdict=Verdict(verdict),
        noise=0.0,
        step=0.0,
        reason=Reason(reason),
    )
