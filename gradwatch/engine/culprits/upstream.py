"""A backward that ignores the gradient arriving from upstream, found where training's gradient is still right.

A custom ``autograd.Function`` may return a gradient it computed in its forward whatever ``grad_output`` is
(warp-ctc's binding: "a long existing bug, especially when you do multitask learning"). Weighted in the loss (a mean of
losses, accumulation, loss scaling), its gradient is wrong and the probes fail with the module named by the culprit
search. As the last operation of an unweighted loss its upstream gradient is exactly 1 and the gradient training uses
is right: no probe can fail, yet the bug is one loss weight away.

A backward is linear in its upstream gradient, so the gradient of ``2 · loss`` is exactly twice the loss's (a power of
two: every rounding scales with it). Only a backward someone wrote may not be: a custom ``autograd.Function`` or a C++
extension's node, which :class:`CustomBackwards` looks for in the reference's graph. Where the graph holds one,
:func:`latent_upstream_bug` differentiates the scaled copy once; where its gradient is not twice the reference's, the
gradients at every module's boundary for both copies name the module whose output gradient doubles and whose input
gradient does not (:func:`turning_point`, which also finds where a gradient turns non-finite). It warns (a note, a
``UserWarning``): training's gradient is right, the verdict stands.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch.engine.culprits.reads import within
from gradwatch.engine.culprits.sites import Site, trace_sites
from gradwatch.engine.culprits.words import LOSS
from gradwatch.engine.function.complex_params import autograd_tensor
from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.function.held import HeldValuesError
from gradwatch.engine.function.values import as_scalar_loss
from gradwatch.engine.numerics.norms import norms
from gradwatch.engine.results.kinds import ProbeKind
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.errors import passes_fallbacks

SCALE = 2.0
"""The factor of the scaled copy of the loss: a power of two, so that a linear backward scales exactly."""

LINEARITY = 1e-3
"""How far, relatively, the scaled copy's gradient may be from ``SCALE`` times the reference's (a non-deterministic
kernel's reordered sums); a backward that ignores its upstream gradient is off by ``1 − 1/SCALE`` of it."""


class CustomBackwards:
    """``loss_fn`` as it is, noting in :attr:`found` the class name of a backward in the graph of the loss it returns
    that is not one of PyTorch's own formulas (``None`` while none was seen), and in :attr:`refused` the name of an
    ``autograd.Function`` there that ``vmap`` refuses (no ``setup_context``, or neither a ``vmap`` rule nor
    ``generate_vmap_rule``), so that no vectorised pass is tried only to fail. Only the first :attr:`SCANS` graphs are
    walked (the reference's), each at most :data:`MOST_NODES` nodes."""

    SCANS = 3

    def __init__(self, loss_fn: Any) -> None:
        self.loss_fn = loss_fn
        self.found: str | None = None
        self.refused: str | None = None
        self._scans = 0

    def __call__(self, model: nn.Module, batch: Any) -> Any:
        loss = self.loss_fn(model, batch)
        node = getattr(loss, "grad_fn", None)
        if self.found is None and node is not None and self._scans < self.SCANS:
            self._scans += 1
            self.found, self.refused = _custom_nodes(node)
        return loss


MOST_NODES = 200_000
"""The most nodes of a graph :class:`CustomBackwards` walks."""


def _custom_nodes(root: Any) -> tuple[str | None, str | None]:
    """The class name of the first node reachable from ``root`` whose backward someone wrote (a Python
    ``autograd.Function``, a C++ extension's ``CppNode``), and the name of the first such ``autograd.Function`` that
    ``vmap`` refuses; each ``None`` where there is none."""
    seen: set[int] = set()
    stack = [root]
    written = torch.autograd.function.BackwardCFunction
    found = refused = None
    while stack and len(seen) < MOST_NODES:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, written) or "CppNode" in type(node).__name__:
            found = found or type(node).__name__
            function = getattr(node, "_forward_cls", None)
            if function is not None and not _vmappable(function):
                return found, function.__name__
        for child, _ in getattr(node, "next_functions", ()):  # a loop: no generator per node of the graph
            stack.append(child)
    return found, refused


def _vmappable(function: type[torch.autograd.Function]) -> bool:
    """Whether ``vmap`` can run ``function`` (as ``torch.autograd.Function.apply`` and functorch decide it)."""
    if function.setup_context is torch.autograd.function._SingleLevelFunction.setup_context:
        return False
    return bool(function.generate_vmap_rule) or function.vmap is not torch.autograd.Function.vmap


def latent_upstream_bug(
    model: nn.Module, evaluator: LossEvaluator, reference_grads: Sequence[Tensor | None]
) -> Note | None:
    """A note naming the module whose backward ignores its upstream gradient, or ``None`` where the gradient of the
    loss scaled by :data:`SCALE` is that many times ``reference_grads``. ``evaluator`` must be on the native
    parameters and inputs."""
    wrt = [autograd_tensor(p) for _, p in evaluator.params]
    original = evaluator.loss_fn
    try:
        evaluator.loss_fn = _scaled(original)
        _, scaled = evaluator.gradients_wrt(lambda: wrt)
    except HeldValuesError:  # values the loss detaches that cannot be held again: the scaled copy proves nothing
        return None
    finally:
        evaluator.loss_fn = original
    off = _relative_offs(scaled, [None if g is None else g * SCALE for g in reference_grads])
    worst = max(off, default=0.0)
    if not worst > LINEARITY:
        return None
    tensors = [name for (name, _), o in zip(evaluator.params, off, strict=True) if o > LINEARITY]
    culprit = _culprit(model, evaluator, original)
    return Note(
        NoteCode.UPSTREAM_IGNORED,
        f"the backward of {culprit} does not scale with the gradient that reaches it: the loss times {SCALE:g} has a "
        f"gradient {worst:.0%} off {SCALE:g} times the loss's (in {', '.join(tensors[:4])}"
        f"{' and more' if len(tensors) > 4 else ''}); the gradient training uses is right only while that module's "
        "output gradient is exactly 1 (an unweighted last operation of the loss): weighted, averaged, accumulated or "
        "loss-scaled, it is wrong (a backward returning a gradient computed in its forward, ignoring grad_output)",
    )


def _scaled(loss_fn: Any) -> Any:
    def scaled(model: nn.Module, batch: Any) -> Tensor:
        return as_scalar_loss(loss_fn(model, batch)) * SCALE

    return scaled


def _relative_offs(found: Sequence[Tensor | None], expected: Sequence[Tensor | None]) -> list[float]:
    """Per tensor, ``‖found − expected‖ / ‖expected‖`` (0 where both are missing or zero, infinite where one is)."""
    offs = []
    for got, want in zip(found, expected, strict=True):
        if got is None and want is None:
            offs.append(0.0)
            continue
        got = torch.zeros_like(want) if got is None else got  # type: ignore[arg-type]
        want = torch.zeros_like(got) if want is None else want
        difference, size = norms([got.double() - want.double(), want.double()], exact=True)
        offs.append(difference / size if size > 0 else (0.0 if difference == 0 else math.inf))
    return offs


def _culprit(model: nn.Module, evaluator: LossEvaluator, original: Any) -> str:
    """The module at which the scaled copy's gradient stops being :data:`SCALE` times the loss's, in words."""
    try:
        plain = trace_sites(model, evaluator)
        evaluator.loss_fn = _scaled(original)
        scaled = trace_sites(model, evaluator)
    except Exception as error:  # the loss refuses hooks on its modules: the finding stands without a name
        if passes_fallbacks(error):
            raise
        return "a module (the loss refuses hooks on its modules, which would name it)"
    finally:
        evaluator.loss_fn = original
    if set(plain) != set(scaled):
        return "a module (the two copies of the loss ran different modules)"

    def faulty(site: Site, place: str) -> bool:
        mine, theirs = site.gradients.get(place, []), scaled[site.name].gradients.get(place, [])
        if len(mine) != len(theirs):
            return True
        return any(o > LINEARITY for o in _relative_offs(theirs, [g * SCALE for g in mine]))

    names = turning_point(plain, faulty)
    return described(names[0], plain) if names else "a module"


INWARD = (ProbeKind.MODULE_INPUT, ProbeKind.MODULE_PARAMS)
"""The places whose gradient a module's own backward computes from the gradient at its outputs."""


def turning_point(sites: Mapping[str, Site], faulty: Callable[[Site, str], bool]) -> list[str]:
    """The innermost module whose output gradient is healthy and whose input or parameter gradient is ``faulty`` (the
    error flows backwards), then the modules containing it that are alike, most specific first; ``[LOSS]`` where only
    outputs are; else ``[]``."""
    wrong_inside = [
        site
        for site in sites.values()
        if not faulty(site, ProbeKind.ACTIVATION) and any(faulty(site, place) for place in INWARD)
    ]
    if wrong_inside:
        innermost = [s for s in wrong_inside if not any(within(o.name, s.name) for o in wrong_inside if o is not s)]
        first = min(innermost, key=lambda s: s.order)
        outer = [s for s in wrong_inside if s is not first and within(first.name, s.name)]
        outer.sort(key=lambda s: -len(s.name))
        return [first.name, *(s.name for s in outer)]
    if any(faulty(site, place) for site in sites.values() for place in (ProbeKind.ACTIVATION, *INWARD)):
        return [LOSS]
    return []


def described(name: str, sites: Mapping[str, Site]) -> str:
    """``name`` in words: "`pose` (`Rotation`)", "the model (`Net`)" or "the loss function's own code"."""
    if name == LOSS:
        return "the loss function's own code"
    site = sites[name]
    return f"`{name}` (`{site.kind}`)" if name else f"the model (`{site.kind}`)"
