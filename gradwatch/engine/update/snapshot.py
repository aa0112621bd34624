"""What an update check keeps before ``optimizer.step()``: :class:`UpdateSnapshot`.

The update of a parameter is a function of its whole tensor (Muon orthogonalises the whole matrix), of its gradient
and of the optimizer's state for it: the check keeps, for the few tensors it checks, a copy of each value, of the
verified gradient (before the loop clips it) and of the optimizer's state for it (its tensors cloned), and the param
group's hyperparameters as they are before the step (a learning-rate scheduler changes them after). Nothing of the
optimizer itself is touched: its state is read, never written.

:func:`update_tensors` chooses them as the applied check chooses those it probes one by one: a few in turn over a series
of checks (``rotation``), a matrix among them when the optimizer updates one (Muon's update is a function of the whole
matrix), tensors too large to copy and step on one device cheaply left out while smaller ones remain.

Under sharding (FSDP2's ``DTensor`` parameters and state, DeepSpeed ZeRO's fp32 partitions) only the checked
tensors and their state are gathered whole (:mod:`gradwatch.engine.distributed.whole`, a collective: every rank takes
the snapshot together), with the share of each tensor each rank updates, so that a wrong share names its rank.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch
from torch import Tensor

from gradwatch.engine.distributed.whole import shares, whole, whole_state, whole_value
from gradwatch.engine.results.numerics import Numerics, current_numerics

__all__ = ["MAX_ELEMENTS", "UPDATE_TENSORS", "KeptParameter", "UpdateSnapshot", "innermost", "update_tensors"]

UPDATE_TENSORS = 3
"""Tensors an update check compares (in turn over a series of checks): the cost is a float64 step of each on the CPU."""

MAX_ELEMENTS = 1 << 22
"""Tensors of more elements are checked only when no smaller one remains (a float64 Newton-Schulz iteration of a
4096×1024 matrix is a few seconds of CPU)."""


def innermost(optimizer: Any) -> Any:
    """The optimizer that holds the state: through wrappers that keep the real one as ``.optimizer`` (Accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``), else ``optimizer`` itself."""
    seen = {id(optimizer)}
    inner = getattr(optimizer, "optimizer", None)
    while inner is not None and isinstance(getattr(inner, "param_groups", None), list) and id(inner) not in seen:
        optimizer, inner = inner, getattr(inner, "optimizer", None)
        seen.add(id(optimizer))
    return optimizer


def update_tensors(
    optimizer: Any, named: Sequence[tuple[str, Tensor]], count: int = UPDATE_TENSORS, rotation: int = 0,
    graded: Collection[str] | None = None,
) -> list[tuple[str, Tensor]]:  # fmt: skip
    """The ``count`` of ``named`` (the checked parameters) an update check compares, in turn from the ``rotation``-th:
    those ``optimizer`` updates (any, for ``None``) that have a gradient (a ``.grad``, or a name in ``graded``: the
    gradients an engine keeps elsewhere), a matrix among them (see the module doc)."""
    updated = None if optimizer is None else {id(p) for g in innermost(optimizer).param_groups for p in g["params"]}
    candidates = [
        (n, p)
        for n, p in named
        if (updated is None or id(p) in updated)
        and p.is_floating_point()
        and (p.grad is not None if graded is None else n in graded)
    ]
    small = [(n, p) for n, p in candidates if getattr(p, "ds_numel", p.numel()) <= MAX_ELEMENTS]  # ZeRO-3: its whole
    candidates = small or candidates
    if len(candidates) <= count:
        return candidates
    first = (rotation * count) % len(candidates)
    chosen = [candidates[(first + k) % len(candidates)] for k in range(count)]
    if not any(len(getattr(p, "ds_shape", p.shape)) >= 2 for _, p in chosen):
        matrices = [(n, p) for n, p in candidates if len(getattr(p, "ds_shape", p.shape)) >= 2]
        if matrices:
            chosen[-1] = matrices[rotation % len(matrices)]
    return chosen


def _copied(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


def _state(param: Tensor, holder: Tensor, value: Any) -> Any:
    """A state entry of ``param``, kept whole: a ``DTensor`` gathered, an entry of a ZeRO flat partition (``holder``)
    gathered as ``param``'s whole tensor of it, anything else as :func:`_copied` keeps it."""
    if isinstance(value, Tensor) and holder is not param and value.shape == holder.shape:
        return whole_state(param, value)
    return _copied(whole(value))


@dataclass(frozen=True)
class KeptParameter:
    """One checked parameter as it was before the step."""

    name: str
    param: Tensor  # the parameter itself (read after the step)
    before: Tensor
    grad: Tensor  # the verified gradient, before the loop clipped it
    state: Mapping[str, Any]  # the optimizer's state for it (tensors cloned)
    hyper: Mapping[str, Any]  # its param group's hyperparameters (without params)
    _: KW_ONLY
    group: int  # the index of its param group
    shares: tuple[tuple[int, int], ...] = ()  # by rank, the (start, count) of the flattened tensor it updates, sharded


@dataclass(frozen=True)
class UpdateSnapshot:
    """What an update check keeps before the step (see the module doc).

    Attributes:
        max_norm: The clip the loop declared (``None``: none): the gradient it steps with is the verified one times
            ``min(1, max_norm / (norm + 1e-6))``.
        numerics: The settings that change the numbers (TF32, reduced-precision reductions, ...) as the step ran under
            them, recorded on the update check's report as on the other checks'.
    """

    optimizer: Any  # the one holding the state, through any wrapper
    kept: tuple[KeptParameter, ...]
    norm: float = 0.0  # the verified gradient's global norm (over every tensor the loop clips), for the declared clip
    max_norm: float | None = None
    previous: Mapping[str, Tensor] = field(default_factory=dict)  # by name, the step before's gradient, when kept
    numerics: Numerics = field(default_factory=current_numerics)

    @classmethod
    def take(
        cls,
        optimizer: Any,
        named: Sequence[tuple[str, Tensor]],
        *,
        norm: float = 0.0,
        max_norm: float | None = None,
        previous: Mapping[str, Tensor] | None = None,
        grads: Mapping[str, Tensor] | None = None,
    ) -> UpdateSnapshot:
        """Keep ``named`` (chosen by :func:`update_tensors`) as they are now, before ``optimizer.step()``; ``grads``:
        by name, the verified gradients when copied earlier (before the loop clipped them), else each ``.grad`` now."""
        outer, optimizer = optimizer, innermost(optimizer)
        # ZeRO: the torch optimizer steps one flat partition per group (ZeRO-3: sub-group) of the module's parameters
        partitioned = getattr(outer, "bit16_groups", None) or getattr(outer, "fp16_groups", None)
        flats = getattr(outer, "fp32_partitioned_groups_flat", None)  # ZeRO-3: one per sub-group, out of its group
        groups = partitioned or [group["params"] for group in optimizer.param_groups]
        group_of = {id(p): i for i, params in enumerate(groups) for p in params}
        kept = []
        with torch.no_grad():
            for name, param in named:
                grad = grads.get(name) if grads is not None else param.grad
                if grad is None or id(param) not in group_of:
                    continue
                index = group_of[id(param)]
                holder = flats[index] if flats else optimizer.param_groups[index]["params"][0] if partitioned else param
                index = outer.sub_group_to_group_id[index] if flats else index
                hyper = {k: _copied(v) for k, v in optimizer.param_groups[index].items() if k != "params"}
                state = {k: _state(param, holder, v) for k, v in optimizer.state.get(holder, {}).items()}
                copied = whole(grad).detach().clone() if grads is None else grad
                before = whole_value(param).detach().clone()
                kept.append(KeptParameter(name, param, before, copied, state, hyper, group=index,
                                          shares=shares(param)))  # fmt: skip
        return cls(optimizer, tuple(kept), float(norm), max_norm, dict(previous or {}))

    def with_clip(self, max_norm: float | None) -> UpdateSnapshot:
        """With the clip the loop declared after the snapshot was taken (``None``: none)."""
        if max_norm is None:
            return self
        return dataclasses.replace(self, max_norm=float(max_norm))

    @property
    def coefficient(self) -> float:
        """The declared clip's coefficient ``min(1, max_norm / (‖g‖ + 1e-6))`` (1 without a clip)."""
        if self.max_norm is None or self.norm + 1e-6 <= 0:
            return 1.0
        return min(1.0, self.max_norm / (self.norm + 1e-6))
