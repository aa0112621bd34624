"""The modules a culprit search probes, and the hooks that displace what only one module sees.

A :class:`Site` is one module of the checked model as the loss's forward pass runs it: how often it is called (a shared
module, a recurrent cell: several times), which module called it first and which modules it calls. A probe can
displace three places of a site, each seen by that module alone:

* ``"activation"``: every floating tensor the module returns, displaced after its forward;
* ``"module_input"``: every floating tensor it receives, displaced before its forward as this module sees it (the
  same tensor fed elsewhere is untouched);
* ``"module_params"``: its own parameters (not its children's), displaced during its own forward only.

:func:`trace_sites` runs the loss once with a zero leaf added at every place of every module, so that one backward
pass gives autograd's gradient at each (a parameter's gradient hooks applied, as in training). :class:`Displacements`
then adds ``offset × v`` at the places a probe moves. Every hook is removed when the recording or the displacement
ends, whatever happens.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module

from gradwatch.engine.culprits.reads import ParameterReads, attribute, direct_reads
from gradwatch.engine.function.batch import map_tensors
from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.results.kinds import kinds_where

PLACES = kinds_where(culprit_search=True)
"""Where a probe can displace a site (see the module doc)."""


@dataclass
class Site:
    """One module as the loss's forward runs it.

    Attributes:
        name: As in ``model.named_modules()`` (``""`` for the model itself), of ``module``.
        order: The position of its first call among all module calls.
        parent: The name of the site whose forward called it first (``None``: the loss function's own code did).
        children: The sites its first call called directly, in order.
        calls: How many times the forward called it.
        gradients: By place, autograd's gradient at each displaced tensor, in call order (zeros where the loss does
            not depend on it through autograd).
        scales: By place, the norm of the displaced tensors, which the probe's step is relative to.
        same_as_parent: The places that hold exactly the parent's tensors (a wrapper whose forward only calls this
            module), whose probes would be the parent's.
    """

    name: str
    module: nn.Module
    order: int
    parent: str | None
    children: list[str] = field(default_factory=list)
    calls: int = 0
    _: KW_ONLY
    gradients: dict[str, list[Tensor]] = field(default_factory=dict)
    scales: dict[str, float] = field(default_factory=dict)
    same_as_parent: set[str] = field(default_factory=set)
    parameters: list[str] = field(default_factory=list)
    """The names of its own trainable floating parameters (``"weight"``), then of those inside it its forward reads
    directly, their owner never called (``"lora_A.default.weight"``: :mod:`.reads`)."""
    last_call: dict[str, int] = field(default_factory=dict)
    """By place, the position in :attr:`gradients` of the first tensor of the last call."""
    strays: bool = False
    """Whether a call of it ran outside a call of :attr:`parent` (a module shared by two parts of the model)."""

    @property
    def kind(self) -> str:
        return type(self.module).__name__

    def probeable(self, place: str) -> bool:
        """Whether the place holds a floating tensor to displace."""
        return bool(self.gradients.get(place))


def floating(obj: Any) -> list[Tensor]:
    """The floating tensors in ``obj``, in traversal order."""
    found: list[Tensor] = []

    def collect(_path: str, tensor: Tensor) -> Tensor:
        if tensor.is_floating_point():
            found.append(tensor)
        return tensor

    map_tensors(obj, "", collect)
    return found


def _direct_parameters(module: nn.Module) -> dict[str, Tensor]:
    return {
        name: p
        for name, p in module.named_parameters(recurse=False)
        if p is not None and p.is_floating_point() and p.requires_grad
    }


class _SiteTracer:
    """The hooks of :func:`trace_sites`: zero leaves added at every place, the call tree written down."""

    def __init__(self, model: nn.Module, reads: dict[str, list[str]] | None = None) -> None:
        self.model = model
        self.reads = reads or {}  # by site, the parameters inside it its forward reads directly (relative names)
        self.parameter_reads = ParameterReads(lambda: self._stack[-1] if self._stack and not self.done else None)
        self.sites: dict[str, Site] = {}
        self.leaves: list[tuple[str, str, Tensor]] = []  # (site, place, leaf)
        self.params: list[tuple[str, Tensor]] = []  # (site, parameter) of each module_params leaf
        self.values: dict[tuple[str, str], list[Tensor]] = {}
        self._stack: list[str] = []
        self._open: list[contextlib.ExitStack] = []
        self._received: dict[str, set[int]] = {}  # ids of the inputs each site's first call received, displaced
        self._returned: dict[str, set[int]] = {}  # ids of the outputs each site's first call returned, displaced
        # the tensors those ids name, held for the recording: a freed tensor's id is reused by a later one, and a
        # module's output would pass for its child's (a child whose output gradient is then never measured)
        self._held: list[Tensor] = []
        self._modes: list[str] = []  # for each open call: "record", "skip" (left alone) or "replay"
        self.grads: list[Tensor | None] = []  # by leaf, autograd's gradient (after the recording's backward pass)
        self.done = False
        """Set once the forward pass has run: the calls of activation checkpointing's recomputation in the backward
        pass are replayed, not recorded (:meth:`_replay`)."""

    def created(self) -> list[Tensor]:
        """The leaves the forward pass added; the recording ends there."""
        self.done = True
        return [leaf for _, _, leaf in self.leaves]

    def _mark_call(self, site: Site, place: str) -> None:
        site.last_call[place] = len(self.values.get((site.name, place), []))

    def _leaf(self, site: str, place: str, tensor: Tensor) -> Tensor:
        leaf = torch.zeros_like(tensor, requires_grad=True)
        self.leaves.append((site, place, leaf))
        self.values.setdefault((site, place), []).append(tensor.detach())
        return tensor + leaf

    @staticmethod
    def _replay(obj: Any) -> Any:
        """``obj`` with a fresh zero leaf added to each floating tensor, as the forward added its recorded ones.

        Activation checkpointing requires its recomputation in the backward pass to save the tensors the forward saved:
        a constant the block makes (PEFT DoRA's ``torch.eye``) required grad in the forward, the recording's leaf added
        to it, and must here too ("a different number of tensors was saved"). These leaves get no gradient; parameters
        need no replay (only those that require grad already are displaced)."""
        return map_tensors(
            obj, "", lambda _p, t: t + torch.zeros_like(t, requires_grad=True) if t.is_floating_point() else t
        )

    def before(self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # a call with grad disabled (inside reentrant activation checkpointing, or a frozen part of the model) gives
        # its leaves no gradient: it is not recorded, and the search names a module around it instead
        grad = torch.is_grad_enabled()
        self._modes.append("skip" if not grad else "replay" if self.done else "record")
        if self._modes[-1] == "replay":
            return self._replay((args, kwargs))
        if self._modes[-1] == "skip":
            return None
        site = self.sites.get(name)
        first = site is None
        if not self.sites:
            self.parameter_reads.observe(self.model)
        if site is None:
            parent = self._stack[-1] if self._stack else None
            site = self.sites[name] = Site(name, module, len(self.sites), parent)
            if parent is not None:
                self.sites[parent].children.append(name)
        site.calls += 1
        if site.parent is not None and site.parent not in self._stack:
            site.strays = True
        self._stack.append(name)
        raw = {id(t) for t in floating((args, kwargs))}
        self._mark_call(site, "module_input")
        self._mark_call(site, "module_params")
        args, kwargs = map_tensors(
            (args, kwargs), "", lambda _p, t: self._leaf(name, "module_input", t) if t.is_floating_point() else t
        )
        if first:
            received = floating((args, kwargs))
            self._held += received
            self._received[name] = {id(t) for t in received}
            if site.parent is not None and raw and raw == self._received.get(site.parent):
                site.same_as_parent.add("module_input")
        stack = contextlib.ExitStack()
        direct = _direct_parameters(module)
        direct.update({relative: attribute(module, relative) for relative in self.reads.get(name, [])})
        if first:
            site.parameters = list(direct)
        if direct:
            displaced = {}
            for param_name, param in direct.items():
                displaced[param_name] = self._leaf(name, "module_params", param)
                self.params.append((name, param))
            stack.enter_context(_reparametrize_module(module, displaced, strict=False))
        self._open.append(stack)
        return args, kwargs

    def after(self, name: str, output: Any) -> Any:
        # a recomputation that checkpoint stops early, once it has what it needs, leaves calls whose forward hook never
        # runs: their entries stay below those of the later calls, which open and close in pairs above them
        mode = self._modes.pop() if self._modes else "skip"
        if mode == "replay":
            return self._replay(output)
        if mode == "skip":
            return None
        self._open.pop().close()
        self._stack.pop()
        site = self.sites[name]
        raw = {id(t) for t in floating(output)}
        self._mark_call(site, "activation")
        output = map_tensors(
            output, "", lambda _p, t: self._leaf(name, "activation", t) if t.is_floating_point() else t
        )
        if site.calls == 1:
            returned = floating(output)
            self._held += returned
            self._returned[name] = {id(t) for t in returned}
            for child in site.children:  # a wrapper that returns its child's output unchanged
                if raw and self._returned.get(child) == raw:
                    self.sites[child].same_as_parent.add("activation")
        return output

    def close(self) -> None:
        while self._open:
            self._open.pop().close()
        self._held.clear()


def trace_sites(model: nn.Module, evaluator: LossEvaluator) -> dict[str, Site]:
    """Every module the loss's forward runs, by name in call order, with autograd's gradient at each of its places,
    from one forward and backward pass on the evaluator's native parameters (two where a module's forward reads
    parameters of a module it never calls: the second displaces them as that module's)."""
    tracer = _trace(model, evaluator, None)
    reads = direct_reads(tracer.parameter_reads.readers, set(tracer.sites))
    return _sites(_trace(model, evaluator, reads) if reads else tracer)


def _trace(model: nn.Module, evaluator: LossEvaluator, reads: dict[str, list[str]] | None) -> _SiteTracer:
    """One forward and backward pass under the recording's hooks."""
    tracer = _SiteTracer(model, reads)
    handles = []
    try:
        for name, module in model.named_modules():
            handles.append(
                module.register_forward_pre_hook(
                    lambda m, a, k, name=name: tracer.before(name, m, a, k), with_kwargs=True
                )
            )
            handles.append(module.register_forward_hook(lambda m, a, o, name=name: tracer.after(name, o)))
        with tracer.parameter_reads if reads is None else contextlib.nullcontext():
            _, tracer.grads = evaluator.gradients_wrt(tracer.created)
    finally:
        tracer.close()
        for handle in handles:
            handle.remove()
    return tracer


def _sites(tracer: _SiteTracer) -> dict[str, Site]:
    """The sites of a recording, with the gradient and scale at each of their places."""
    sites, grads = tracer.sites, tracer.grads
    # the gradient hooks on each parameter (`register_hook`), which autograd runs on its total gradient in training: a
    # bug in one belongs to the module owning the parameter
    hooks_of = [list((getattr(param, "_backward_hooks", None) or {}).values()) for _, param in tracer.params]
    param_leaves = iter(hooks_of)
    for (name, place, leaf), grad in zip(tracer.leaves, grads, strict=True):
        if grad is None:
            grad = torch.zeros_like(leaf)
        if place == "module_params":
            for hook in next(param_leaves):
                changed = hook(grad)
                grad = changed if changed is not None else grad
        sites[name].gradients.setdefault(place, []).append(grad.detach())
    for (name, place), values in tracer.values.items():
        sites[name].scales[place] = math.sqrt(sum(float(v.double().square().sum()) for v in values))
    for site in sites.values():
        # the parent's input gradient is the child's only where the parent is a wrapper: its one child, whose output it
        # returns; a parent that feeds the same input to several children (an MLP's gate and up projections) or uses it
        # itself (a residual) gives its children input gradients of their own, which are measured
        parent = sites.get(site.parent) if site.parent is not None else None
        if parent is not None and (len(parent.children) != 1 or "activation" not in site.same_as_parent):
            site.same_as_parent.discard("module_input")
    return dict(sorted(sites.items(), key=lambda item: item[1].order))


class Displacements:
    """Hooks that add ``offset × direction`` at ``place`` (one of :data:`PLACES`) of ``site`` during the loss
    evaluations of a probe; ``direction`` holds one tensor per displaced tensor in call order (as
    :attr:`Site.gradients`)."""

    def __init__(self, site: Site, place: str, direction: list[Tensor]) -> None:
        self.site = site
        self.place = place
        self.direction = direction
        self.offset = 0.0
        self._position = 0
        self._handles: list[Any] = []
        self._open: list[contextlib.ExitStack] = []

    def set_offset(self, offset: float) -> None:
        """Displace by ``offset`` from the next evaluation on (0: not at all)."""
        self.offset = offset
        self._position = 0

    def _next(self, tensor: Tensor) -> Tensor:
        if self._position >= len(self.direction):
            return tensor
        component = self.direction[self._position]
        self._position += 1
        if self.offset == 0.0 or component.shape != tensor.shape:
            return tensor
        return tensor + self.offset * component.to(dtype=tensor.dtype, device=tensor.device)

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        stack = contextlib.ExitStack()
        if self.place == "module_input":
            args, kwargs = map_tensors((args, kwargs), "", lambda _p, t: self._next(t) if t.is_floating_point() else t)
        elif self.place == "module_params":
            # by name: under float64 storage the module holds float64 substitutes, not its Parameters
            moved = {name: self._next(attribute(module, name)) for name in self.site.parameters}
            stack.enter_context(_reparametrize_module(module, moved, strict=False))
        self._open.append(stack)
        return args, kwargs

    def _after(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self._open:
            self._open.pop().close()
        if self.place == "activation":
            output = map_tensors(output, "", lambda _p, t: self._next(t) if t.is_floating_point() else t)
        return output

    @contextlib.contextmanager
    def installed(self) -> Iterator[Displacements]:
        """The hooks on the site's module for the duration."""
        module = self.site.module
        self._handles = [
            module.register_forward_pre_hook(self._before, with_kwargs=True),
            module.register_forward_hook(self._after),
        ]
        try:
            yield self
        finally:
            for handle in self._handles:
                handle.remove()
            while self._open:
                self._open.pop().close()
            self.offset = 0.0
