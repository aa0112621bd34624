"""DeepSpeed ZeRO's models, recognised by their attributes: gradwatch never imports deepspeed.

Under ZeRO stages 1 and 2 every rank holds every parameter whole (only the optimizer state and, in stage 2, the
gradients are partitioned), so a model is checked as under DDP: every rank's loss, the gradient the optimizer applies
(DeepSpeed's ``safe_get_full_grad``) against the mean of the ranks' window losses. Under stage 3 each parameter is a
flat partition per rank (``param.ds_tensor``; the parameter itself is empty between forwards) that DeepSpeed's module
hooks gather before each module's forward and backward and release after. A check :func:`gathered` them whole on every
rank for its duration, with those hooks set aside, so that the model is a plain replicated module while it is probed;
afterwards the partitions are as they were (DeepSpeed re-partitions a gathered parameter from its partition, which no
probe touched). Gathering costs one full copy of the model per rank for the duration of a check.

Whatever the stage, each rank owns (updates) a contiguous range of each flattened parameter: :func:`owned_range`. When
the applied gradient is wrong only in some ranks' ranges, :func:`ranks_owning_wrong_rows` names those ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ParamSpec

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.engine.notes import Note, NoteCode
from gradwatch.engine.report import CheckReport

ZERO3_NOTE = (
    "DeepSpeed ZeRO-3: every partitioned parameter gathered whole on every rank for the check, DeepSpeed's module "
    "hooks set aside; the partitions are as they were afterwards"
)

Options = ParamSpec("Options")

_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def is_engine(model: Any) -> bool:
    """Whether ``model`` is a DeepSpeed engine (``deepspeed.initialize``'s first result) wrapping a module."""
    return (
        isinstance(model, nn.Module)
        and isinstance(getattr(model, "module", None), nn.Module)
        and all(hasattr(model, name) for name in ("is_gradient_accumulation_boundary", "zero_optimization_stage"))
    )


def unwrapped(model: nn.Module) -> nn.Module:
    """The module a DeepSpeed engine wraps (``model`` itself otherwise). A check runs the loss on the module: the
    engine's own forward registers hooks that divide the output's gradient by the accumulation steps and drive its
    optimizer's backward bookkeeping, neither of which belongs in a check's evaluations."""
    return model.module if is_engine(model) else model  # type: ignore[return-value]


def unprefixed(gradients: Any, model: nn.Module) -> Any:
    """``gradients`` keyed by the names of the engine's parameters (``module.…``) keyed by the wrapped module's."""
    if is_engine(model) and isinstance(gradients, Mapping) and all(str(k).startswith("module.") for k in gradients):
        return {str(k).removeprefix("module."): v for k, v in gradients.items()}
    return gradients


def partitioned(model: nn.Module) -> list[nn.Parameter]:
    """The ZeRO-3 partitioned parameters of ``model``, in DeepSpeed's order (by ``ds_id``, the same on every rank)."""
    found = [p for p in model.parameters() if hasattr(p, "ds_id") and hasattr(p, "ds_tensor")]
    return sorted(found, key=lambda p: p.ds_id)  # type: ignore[no-any-return]


def _deepspeed_hook(hook: Any) -> bool:
    module = getattr(inspect.unwrap(hook), "__module__", None) or ""
    return module.split(".")[0] == "deepspeed"


@contextlib.contextmanager
def _deepspeed_hooks_set_aside(model: nn.Module) -> Iterator[None]:
    """For the duration, ``model``'s modules run without DeepSpeed's hooks (those that gather and release partitioned
    parameters); the other hooks run as before. The very hook dictionaries are put back afterwards."""
    saved: list[tuple[nn.Module, str, Any]] = []
    for module in model.modules():
        for attribute in _HOOKS:
            hooks = module.__dict__.get(attribute)
            if hooks and any(_deepspeed_hook(hook) for hook in hooks.values()):
                saved.append((module, attribute, hooks))
                module.__dict__[attribute] = OrderedDict((k, h) for k, h in hooks.items() if not _deepspeed_hook(h))
    try:
        yield
    finally:
        for module, attribute, hooks in saved:
            module.__dict__[attribute] = hooks


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
        with _deepspeed_hooks_set_aside(model):
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


def on_whole_parameters(check: Callable[Options, CheckReport]) -> Callable[Options, CheckReport]:
    """Make a check of a model (its first argument) take DeepSpeed models too: a DeepSpeed engine is checked through
    the module it wraps (:func:`unwrapped`, with ``gradients`` keyed by the engine's parameter names re-keyed), a
    ZeRO-3 model with its parameters :func:`gathered`, and the process group of an applied check defaults to the one
    ZeRO averages gradients over."""

    @functools.wraps(check)
    def run(*args: Options.args, **kwargs: Options.kwargs) -> CheckReport:
        model = args[0] if args else kwargs.get("model")
        if not isinstance(model, nn.Module) or not (
            is_engine(model) or any(owned_range(p) is not None for p in model.parameters())
        ):
            return check(*args, **kwargs)
        inner = unwrapped(model)
        values = list(args)
        values[0:1] = [inner] if args else []
        if "model" in kwargs:
            kwargs["model"] = inner
        if len(values) > 3:
            values[3] = unprefixed(values[3], model)
        if "gradients" in kwargs:
            kwargs["gradients"] = unprefixed(kwargs["gradients"], model)
        if "group" in inspect.signature(check).parameters and kwargs.get("group") is None:
            kwargs["group"] = data_parallel_group(inner) if dist.is_initialized() else None
        with gathered(inner) as whole:
            report = check(*values, **kwargs)  # type: ignore[arg-type]
        if not whole:
            return report
        return dataclasses.replace(report, notes=[*report.notes, Note(NoteCode.ZERO3_GATHERED, ZERO3_NOTE)])

    return run
