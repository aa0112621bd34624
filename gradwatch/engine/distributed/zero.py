"""DeepSpeed ZeRO's models, recognised by their attributes: gradwatch never imports deepspeed.

Under ZeRO stages 1 and 2 every rank holds every parameter whole, so a model is checked as under DDP: every rank's loss,
the gradient the optimizer applies (DeepSpeed's ``safe_get_full_grad``) against the mean of the ranks' window losses.
Under stage 3 each parameter is a flat partition per rank (``param.ds_tensor``; the parameter itself is empty between
forwards) that DeepSpeed's module hooks gather around each module's forward and backward. A check :func:`gathered`
them whole on every rank for its duration, those hooks set aside, so that the model is a plain replicated module while
it is probed (one full copy of the model per rank); afterwards DeepSpeed re-partitions them from their partitions,
which no probe touched.

Whatever the stage, each rank owns (updates) a contiguous range of each flattened parameter (:func:`owned_range`);
when the applied gradient is wrong only in some ranks' ranges, :func:`ranks_owning_wrong_rows` names those ranks.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.engine.distributed import hooks_set_aside

ZERO3_NOTE = (
    "DeepSpeed ZeRO-3: every partitioned parameter gathered whole on every rank for the check, DeepSpeed's module "
    "hooks set aside; the partitions are as they were afterwards"
)


def is_engine(model: Any) -> bool:
    """Whether ``model`` is a DeepSpeed engine (``deepspeed.initialize``'s first result) wrapping a module."""
    return _engine_class(type(model)) and isinstance(getattr(model, "module", None), nn.Module)


def _has_engine_methods(kind: Any) -> bool:
    return issubclass(kind, nn.Module) and all(hasattr(kind, name) for name in _ENGINE_METHODS)


_engine_class: Callable[[Any], bool] = functools.cache(_has_engine_methods)
"""Whether a class is a module class with a DeepSpeed engine's methods, asked of the class once: a plain module's class
has neither, and each ``hasattr`` of a missing attribute builds an error (the watch asks at every training step)."""


_ENGINE_METHODS = ("is_gradient_accumulation_boundary", "zero_optimization_stage")
"""Methods of a DeepSpeed engine's class."""


def unwrapped(model: nn.Module) -> nn.Module:
    """The module a DeepSpeed engine wraps (``model`` itself otherwise). A check runs the loss on the module: the
    engine's own forward registers hooks that divide the output's gradient by the accumulation steps and drive its
    optimizer's backward bookkeeping, neither of which belongs in a check's evaluations."""
    if not _engine_class(type(model)):  # asked at every training step: a plain module's class answers at once
        return model
    return model.module if is_engine(model) else model  # type: ignore[return-value]


def unprefixed(gradients: Any, model: nn.Module) -> Any:
    """``gradients`` keyed by the names of the engine's parameters (``module.…``) keyed by the wrapped module's."""
    if is_engine(model) and isinstance(gradients, Mapping) and all(str(k).startswith("module.") for k in gradients):
        return {str(k).removeprefix("module."): v for k, v in gradients.items()}
    return gradients


def full_gradient(param: Tensor) -> Tensor | None:
    """The full gradient DeepSpeed is about to apply to ``param``, as ``deepspeed.utils.safe_get_full_grad`` reads it
    (by the attributes DeepSpeed gives its parameters): the bf16 optimizer's accumulation buffer, else ``.grad``, else
    the ZeRO-3 partitions gathered, else the ZeRO-1/2 partitions gathered; ``None`` without one. At the accumulation
    boundary, before the engine steps, it is the reduced, accumulated gradient before clipping. A collective."""
    if getattr(param, "_hp_grad", None) is not None:
        return param.get_full_hp_grad()  # type: ignore[attr-defined,no-any-return]
    if param.grad is not None:
        return param.grad
    if hasattr(param, "ds_id"):
        return param._z3_optimizer.get_fp32_grad_for_param(param)  # type: ignore[attr-defined,no-any-return]
    if hasattr(param, "_hp_mapping"):
        return param.get_full_hp_grad()  # type: ignore[attr-defined,no-any-return]
    return None


def engine_module(engine: Any) -> nn.Module:
    if not is_engine(engine):
        raise TypeError(f"`engine` must be a DeepSpeed engine (deepspeed.initialize's first result); got "
                        f"{type(engine).__name__}")  # fmt: skip
    return engine.module  # type: ignore[no-any-return]


def full_gradients(engine: Any) -> dict[str, Tensor]:
    """The gradient the engine is about to apply, by name of the wrapped module's parameters: each trainable
    parameter's full, reduced, accumulated gradient before clipping (:func:`full_gradient`), in float32. Call it at
    the accumulation boundary (``engine.is_gradient_accumulation_boundary()``, after the last micro-batch's
    ``engine.backward``, before ``engine.step()``), on every rank together: it gathers the gradient's partitions.

    Args:
        engine: A DeepSpeed engine (``deepspeed.initialize``'s first result).
    """
    found = {}
    for name, param in engine_module(engine).named_parameters():
        if param.requires_grad:
            gradient = full_gradient(param)
            if gradient is not None:
                found[name] = gradient
    return found


class FullGradients(Mapping[str, Tensor]):
    """:func:`full_gradients` of ``engine``, gathered when first read: what a loop passes as ``gradients=`` at every
    accumulation boundary (and what a watch handed the engine itself reads), paying the gathering only when a check is
    due and reads it (every rank reads it then, as every rank runs the check).

    Args:
        engine: A DeepSpeed engine (``deepspeed.initialize``'s first result).
    """

    def __init__(self, engine: Any) -> None:
        engine_module(engine)
        self.engine = engine
        self._found: dict[str, Tensor] | None = None

    def _gradients(self) -> dict[str, Tensor]:
        if self._found is None:
            self._found = full_gradients(self.engine)
        return self._found

    def __getitem__(self, name: str) -> Tensor:
        return self._gradients()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._gradients())

    def __len__(self) -> int:
        return len(self._gradients())


def clipped_norm(engine: Any) -> float | None:
    """The norm the engine's optimizer clipped its last step's gradient with (unscaled; DeepSpeed's ZeRO and bf16
    optimizers keep it as ``_global_grad_norm``, which the engine returns as ``get_global_grad_norm()`` once its step
    is over); ``None`` when it keeps no such norm or skipped the step (a non-finite norm). Reading it may wait for the
    device.

    Args:
        engine: A DeepSpeed engine (``deepspeed.initialize``'s first result).
    """
    norm = getattr(engine.optimizer, "_global_grad_norm", None)
    if norm is None:
        norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    norm = float(norm)
    return norm if 0 <= norm < float("inf") else None  # NaN and inf: a skipped step


def partitioned(model: nn.Module) -> list[nn.Parameter]:
    """The ZeRO-3 partitioned parameters of ``model``, in DeepSpeed's order (by ``ds_id``, the same on every rank)."""
    found = [p for p in model.parameters() if hasattr(p, "ds_id") and hasattr(p, "ds_tensor")]
    return sorted(found, key=lambda p: p.ds_id)  # type: ignore[no-any-return]


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[bool]:
    """Under ZeRO-3, every partitioned parameter of ``model`` gathered whole, on every rank, with DeepSpeed's module
    hooks set aside; yields whether there were any. A collective: every rank enters together. On leaving, the
    parameters gathered here are partitioned again from their partitions (whatever was written into the gathered
    tensors is dropped, as ``deepspeed.zero.GatheredParameters`` without a ``modifier_rank`` drops it), and those that
    were gathered before (DeepSpeed's persistent parameters) stay gathered."""
    params = partitioned(model)
    if not params:
        yield False
        return
    released = [p for p in params if getattr(p.ds_status, "name", "") != "AVAILABLE"]  # type: ignore[attr-defined]
    if released:
        released[0].all_gather(param_list=released)  # type: ignore[attr-defined]
    try:
        with hooks_set_aside(model, "deepspeed"):
            yield True
    finally:
        if released:
            released[0].partition(param_list=released, has_been_updated=False)  # type: ignore[attr-defined]


def owned_range(param: Tensor) -> tuple[int, int] | None:
    """``(start, count)``: the elements of the flattened ``param`` whose update this rank owns under ZeRO (its
    partition of the gradient and optimizer state); ``None`` if the parameter is not ZeRO's."""
    if hasattr(param, "ds_tensor") and hasattr(param, "ds_process_group"):
        size = param.ds_tensor.numel()  # type: ignore[attr-defined]
        start = dist.get_rank(param.ds_process_group) * size  # type: ignore[attr-defined]
        return start, max(0, min(size, param.ds_numel - start))  # type: ignore[attr-defined]
    if hasattr(param, "_hp_mapping"):
        mapping = param._hp_mapping  # type: ignore[attr-defined]
        if mapping is None:
            return 0, 0
        return mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
    return None


def ranks_owning_wrong_rows(
    params: Sequence[Tensor],
    applied: Sequence[Tensor],
    recomputed: Sequence[Tensor],
    floors: Sequence[float],
    group: Any,
) -> list[int]:
    """Under ZeRO, the ranks of ``group`` whose owned ranges of the applied gradient are farther from the same ranges
    ``recomputed`` than each tensor's floor allows them (a rank's range may take all of it); ``[]`` for a model that
    is not ZeRO's. A collective: every rank calls it together."""
    ranges = [owned_range(p) for p in params]
    if not any(r is not None for r in ranges):
        return []
    wrong = False
    for found, a, r, floor in zip(ranges, applied, recomputed, floors, strict=True):
        if found is None or not found[1] or not math.isfinite(floor):
            continue
        start, count = found
        difference = (
            a.detach().reshape(-1)[start : start + count].double() - r.reshape(-1)[start : start + count].double()
        )
        wrong = wrong or float(torch.linalg.vector_norm(difference)) > floor
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.float64)
    flags[dist.get_rank(group)] = 1.0 if wrong else 0.0
    dist.all_reduce(flags, group=group)
    return [rank for rank, flag in enumerate(flags.tolist()) if flag]


def data_parallel_group(model: nn.Module) -> Any:
    """The process group ZeRO partitions ``model``'s parameters over (``None`` for a model that is not ZeRO's)."""
    for param in model.parameters():
        for attribute in ("ds_process_group", "_dp_group"):
            if getattr(param, attribute, None) is not None:
                return getattr(param, attribute)
    return None
