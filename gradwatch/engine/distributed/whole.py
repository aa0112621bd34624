"""Checks of models whose parameters a parallelising library splits across ranks other than FSDP2's rows: DeepSpeed
ZeRO (:mod:`.zero`) and tensor parallelism (:mod:`.tensor_parallel`), run on the parameters made whole.

:func:`on_whole_parameters` adapts a check function (:func:`~gradwatch.check_gradients`,
:func:`~gradwatch.check_applied_gradient`): its model argument unwrapped, made whole for the duration, the applied
gradients given made whole and keyed by the checked module's names, and the process group of an applied check
defaulting to the one the library averages (ZeRO) or replicates (tensor parallelism) over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec

import torch.distributed as dist
from torch import nn

from gradwatch.engine.distributed import tensor_parallel, zero
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import CheckReport

Options = ParamSpec("Options")


def on_whole_parameters(check: Callable[Options, CheckReport]) -> Callable[Options, CheckReport]:
    """Make a check of a model (its first argument) take DeepSpeed and tensor-parallel models (see the module doc)."""
    takes_group = "group" in inspect.signature(check).parameters

    @functools.wraps(check)
    def run(*args: Options.args, **kwargs: Options.kwargs) -> CheckReport:
        values: list[Any] = list(args)
        model = values[0] if values else kwargs.get("model")
        if not isinstance(model, nn.Module):
            return check(*args, **kwargs)
        is_zero = zero.is_engine(model) or any(zero.owned_range(p) is not None for p in model.parameters())
        is_tp = not is_zero and tensor_parallel.is_tensor_parallel(model)
        if not (is_zero or is_tp):
            return check(*args, **kwargs)
        inner = zero.unwrapped(model)
        values[0:1] = [inner] if values else []
        if "model" in kwargs:
            kwargs["model"] = inner
        if takes_group:  # an applied check: its gradients, whole and by the checked module's names
            given = zero.unprefixed(values[3] if len(values) > 3 else kwargs.get("gradients"), model)
            if is_tp:
                given = tensor_parallel.whole_gradients(inner, given)
            if len(values) > 3:
                values[3] = given
            else:
                kwargs["gradients"] = given
            if kwargs.get("group") is None and dist.is_initialized():
                kwargs["group"] = zero.data_parallel_group(inner) if is_zero else tensor_parallel.mesh_group(inner)
        note: Note | None = None
        with contextlib.ExitStack() as stack:
            if is_tp:
                stack.enter_context(tensor_parallel.made_plain(inner))
                note = Note(NoteCode.TENSOR_PARALLEL, tensor_parallel.TENSOR_PARALLEL_NOTE)
            else:
                note = (
                    Note(NoteCode.ZERO3_GATHERED, zero.ZERO3_NOTE)
                    if stack.enter_context(zero.gathered(inner))
                    else None
                )
            report = check(*values, **kwargs)
        return report if note is None else dataclasses.replace(report, notes=[*report.notes, note])

    return run
