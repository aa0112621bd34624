"""Finding the floating tensors of a batch, and rebuilding a batch with some of them replaced.

A batch may be a tensor or any nesting of tuples, lists, dicts, namedtuples and dataclasses. Each floating tensor is
named by the path a user would type to reach it (``batch[0]``, ``batch['x']``, ``batch.pixels``), which is how input
probes are reported. Integer and boolean tensors (token ids, masks) are left alone, except by :func:`leading_slice`,
which cuts every per-sample tensor of a batch down to its first samples.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

ROOT = "batch"


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def map_tensors(obj: Any, path: str, fn: Callable[[str, Tensor], Tensor]) -> Any:
    """Return ``obj`` with every tensor ``t`` at ``path`` replaced by ``fn(path, t)``; containers are copied only
    where something below them changed, so untouched parts of the batch keep their identity."""
    if isinstance(obj, Tensor):
        return fn(path, obj)
    if _is_namedtuple(obj):
        items = [map_tensors(getattr(obj, f), f"{path}.{f}", fn) for f in obj._fields]
        changed = any(new is not old for new, old in zip(items, obj, strict=True))
        return type(obj)(*items) if changed else obj
    if isinstance(obj, (list, tuple)):
        elements = [map_tensors(item, f"{path}[{i}]", fn) for i, item in enumerate(obj)]
        if all(new is old for new, old in zip(elements, obj, strict=True)):
            return obj
        if isinstance(obj, list):
            rebuilt_list = copy.copy(obj)
            rebuilt_list[:] = elements
            return rebuilt_list
        return type(obj)(elements)
    if isinstance(obj, Mapping):
        entries = {key: map_tensors(value, f"{path}[{key!r}]", fn) for key, value in obj.items()}
        if all(entries[key] is value for key, value in obj.items()):
            return obj
        rebuilt_mapping: Any = copy.copy(obj)
        for key, value in entries.items():
            rebuilt_mapping[key] = value
        return rebuilt_mapping
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        fields = {name: map_tensors(value, f"{path}.{name}", fn) for name, value in values.items()}
        if all(fields[name] is value for name, value in values.items()):
            return obj
        rebuilt = copy.copy(obj)
        for name, value in fields.items():
            object.__setattr__(rebuilt, name, value)  # works for frozen dataclasses too
        return rebuilt
    return obj


def floating_tensors(batch: Any) -> dict[str, Tensor]:
    """The floating-point tensors of ``batch``, keyed by path, in traversal order.

    A tensor that appears twice (the same object under two paths) is listed once, under its first path.
    """
    found: dict[str, Tensor] = {}
    seen: set[int] = set()

    def collect(path: str, tensor: Tensor) -> Tensor:
        if tensor.is_floating_point() and id(tensor) not in seen:
            seen.add(id(tensor))
            found[path] = tensor
        return tensor

    map_tensors(batch, ROOT, collect)
    return found


def replace_tensors(batch: Any, replacements: Mapping[str, Tensor]) -> Any:
    """A copy of ``batch`` in which the tensor at each path of ``replacements`` is swapped for the given one.

    The original batch is not modified. Paths are those of :func:`floating_tensors`. A tensor object listed under one
    path is replaced wherever it appears, so a batch that reuses one tensor twice stays consistent.
    """
    if not replacements:
        return batch
    originals = floating_tensors(batch)
    by_identity = {id(originals[path]): new for path, new in replacements.items() if path in originals}
    unknown = sorted(set(replacements) - set(originals))
    if unknown:
        raise KeyError(f"no floating tensor at {unknown} in the batch; known paths: {sorted(originals)}")
    return map_tensors(batch, ROOT, lambda path, tensor: by_identity.get(id(tensor), tensor))


def batch_size(batch: Any) -> int | None:
    """The number of samples in ``batch``: the most common first dimension of its tensors (``None`` without any).

    Ties go to the larger size: a batch of 8 images with 8 labels and a 3-element class weight has 8 samples.
    """
    sizes: Counter[int] = Counter()

    def count(_path: str, tensor: Tensor) -> Tensor:
        if tensor.dim() > 0:
            sizes[tensor.shape[0]] += 1
        return tensor

    map_tensors(batch, ROOT, count)
    if not sizes:
        return None
    return max(sizes, key=lambda size: (sizes[size], size))


def leading_slice(batch: Any, size: int) -> Any:
    """``batch`` with every tensor whose first dimension is the batch size cut to its first ``size`` entries.

    Tensors of any dtype are cut (labels go with their inputs); other tensors and objects are kept. The slices are
    views, so nothing is copied. The batch itself is returned when it has no more than ``size`` samples.
    """
    full = batch_size(batch)
    if full is None or full <= size:
        return batch
    return map_tensors(batch, ROOT, lambda _path, t: t[:size] if t.dim() > 0 and t.shape[0] == full else t)
