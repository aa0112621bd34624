"""Finding the floating tensors of a batch, and rebuilding a batch with some of them replaced.

A batch may be a tensor or any nesting of tuples, lists, dicts, namedtuples, dataclasses and records: objects with
tensor attributes and a ``.to()``/``.apply()`` protocol, as graph libraries' batches are (torch_geometric's
``Data``/``Batch``: ``batch.x``, ``batch.edge_index``). Each floating tensor is named by the path a user would type to
reach it (``batch[0]``, ``batch['x']``, ``batch.pixels``), as input probes are reported. Integer and boolean tensors
(token ids, masks) are left alone, except by :func:`leading_slice`. Objects holding tensors that none of these
describe are :func:`opaque_parts`: a check names them in a note.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor
from torch.nn import Module

ROOT = "batch"


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _is_record(obj: object) -> bool:
    """An object with tensor attributes and the ``.to()``/``.apply()`` protocol of graph batches."""
    kind = type(obj)
    return (
        callable(getattr(kind, "apply", None)) and callable(getattr(kind, "to", None)) and not isinstance(obj, Module)
    )


def _record_fields(obj: Any) -> dict[str, Any]:
    """A record's attributes: its ``keys()`` (torch_geometric) or else its instance attributes, in sorted order."""
    keys = getattr(obj, "keys", None)
    if callable(keys):
        try:
            return {str(key): obj[key] for key in sorted(keys())}
        except (TypeError, KeyError):
            pass
    return dict(sorted(vars(obj).items())) if hasattr(obj, "__dict__") else {}


def _map_record(obj: Any, path: str, fn: Callable[[str, Tensor], Tensor]) -> Any:
    values = _record_fields(obj)
    fields = {name: map_tensors(value, f"{path}.{name}", fn) for name, value in values.items()}
    if all(fields[name] is value for name, value in values.items()):
        return obj
    rebuilt = copy.copy(obj)  # torch_geometric's copy gets its own attribute store
    for name, value in fields.items():
        if value is not values[name]:
            if callable(getattr(obj, "keys", None)):
                rebuilt[name] = value
            else:
                setattr(rebuilt, name, value)
    return rebuilt


def map_tensors(obj: Any, path: str, fn: Callable[[str, Tensor], Tensor], records: bool = True) -> Any:
    """``obj`` with every tensor ``t`` at ``path`` replaced by ``fn(path, t)``, containers copied only where something
    below them changed; records (graph batches) traversed unless ``records`` is false."""
    if isinstance(obj, Tensor):
        return fn(path, obj)
    if not records and _is_record(obj):
        return obj
    if _is_namedtuple(obj):
        items = [map_tensors(getattr(obj, f), f"{path}.{f}", fn, records) for f in obj._fields]
        changed = any(new is not old for new, old in zip(items, obj, strict=True))
        return type(obj)(*items) if changed else obj
    if isinstance(obj, (list, tuple)):
        elements = [map_tensors(item, f"{path}[{i}]", fn, records) for i, item in enumerate(obj)]
        if all(new is old for new, old in zip(elements, obj, strict=True)):
            return obj
        if isinstance(obj, list):
            rebuilt_list = copy.copy(obj)
            rebuilt_list[:] = elements
            return rebuilt_list
        return type(obj)(elements)
    if isinstance(obj, Mapping):
        entries = {key: map_tensors(value, f"{path}[{key!r}]", fn, records) for key, value in obj.items()}
        if all(entries[key] is value for key, value in obj.items()):
            return obj
        rebuilt_mapping: Any = copy.copy(obj)
        for key, value in entries.items():
            rebuilt_mapping[key] = value
        return rebuilt_mapping
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        fields = {name: map_tensors(value, f"{path}.{name}", fn, records) for name, value in values.items()}
        if all(fields[name] is value for name, value in values.items()):
            return obj
        rebuilt = copy.copy(obj)
        for name, value in fields.items():
            object.__setattr__(rebuilt, name, value)  # works for frozen dataclasses too
        return rebuilt
    if records and _is_record(obj):
        return _map_record(obj, path, fn)
    return obj


def floating_tensors(batch: Any) -> dict[str, Tensor]:
    """The floating-point tensors of ``batch``, keyed by path, in traversal order (one under two paths: the first)."""
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
    """A copy of ``batch`` with the tensor at each path of ``replacements`` (:func:`floating_tensors`' paths) swapped
    for the given one, wherever that tensor object appears."""
    if not replacements:
        return batch
    originals = floating_tensors(batch)
    by_identity = {id(originals[path]): new for path, new in replacements.items() if path in originals}
    unknown = sorted(set(replacements) - set(originals))
    if unknown:
        raise KeyError(f"no floating tensor at {unknown} in the batch; known paths: {sorted(originals)}")
    return map_tensors(batch, ROOT, lambda path, tensor: by_identity.get(id(tensor), tensor))


def _graphs(obj: object) -> int | None:
    """The number of graphs of a graph batch that can be cut into its first graphs (torch_geometric's ``Batch``), else
    ``None``."""
    if not (_is_record(obj) and callable(getattr(obj, "to_data_list", None))):
        return None
    if not callable(getattr(type(obj), "from_data_list", None)):
        return None
    count = getattr(obj, "num_graphs", None)
    return count if isinstance(count, int) else None


def _first_graphs(obj: Any, size: int) -> Any:
    return type(obj).from_data_list(obj.to_data_list()[:size])


def _sizes(batch: Any) -> Counter[int]:
    """The first dimensions of the batch's tensors outside records, and the graph count of each graph batch."""
    sizes: Counter[int] = Counter()

    def count(_path: str, tensor: Tensor) -> Tensor:
        if tensor.dim() > 0:
            sizes[tensor.shape[0]] += 1
        return tensor

    map_tensors(batch, ROOT, count, records=False)
    for graphs in _graph_batches(batch):
        sizes[graphs] += 1
    return sizes


def _graph_batches(obj: Any) -> list[int]:
    """The graph counts of the graph batches in ``obj`` (at its top or in its tuples, lists and dicts)."""
    found = _graphs(obj)
    if found is not None:
        return [found]
    if isinstance(obj, (list, tuple)):
        return [n for item in obj for n in _graph_batches(item)]
    if isinstance(obj, Mapping):
        return [n for value in obj.values() for n in _graph_batches(value)]
    return []


def batch_size(batch: Any) -> int | None:
    """The number of samples in ``batch``: the most common first dimension of its tensors, the larger on a tie, a
    graph batch counting its graphs (``None`` without any)."""
    sizes = _sizes(batch)
    if not sizes:
        return None
    return max(sizes, key=lambda size: (sizes[size], size))


def leading_slice(batch: Any, size: int) -> Any:
    """``batch`` with every tensor whose first dimension is the batch size (of any dtype: labels go with their inputs)
    cut to its first ``size`` entries, as views, and every graph batch of that many graphs rebuilt from its first
    ``size``. Tensors inside records (their node and edge dimensions are not per-sample) are kept; the batch itself
    when it has no more than ``size`` samples.
    """
    full = batch_size(batch)
    if full is None or full <= size:
        return batch
    return _cut(batch, size, full)


def _cut(obj: Any, size: int, full: int) -> Any:
    if _graphs(obj) == full:
        return _first_graphs(obj, size)
    if isinstance(obj, (list, tuple)) and not _is_namedtuple(obj) and any(_graph_batches(item) for item in obj):
        items = [_cut(item, size, full) for item in obj]
        return type(obj)(items) if isinstance(obj, tuple) else items
    if isinstance(obj, Mapping) and any(_graph_batches(value) for value in obj.values()):
        rebuilt: Any = copy.copy(obj)
        for key, value in obj.items():
            rebuilt[key] = _cut(value, size, full)
        return rebuilt
    return map_tensors(obj, ROOT, lambda _path, t: t[:size] if t.dim() > 0 and t.shape[0] == full else t, records=False)


def complex_inputs(batch: Any) -> list[str]:
    """The paths of the complex tensors of ``batch``: they are neither probed nor promoted (a note names them)."""
    found: list[str] = []

    def collect(path: str, tensor: Tensor) -> Tensor:
        if tensor.is_complex():
            found.append(path)
        return tensor

    map_tensors(batch, ROOT, collect)
    return found


def opaque_parts(batch: Any) -> list[str]:
    """The paths of objects in ``batch`` that hold tensors as attributes but are neither containers nor records (their
    tensors are not probed)."""
    found: list[str] = []

    def visit(obj: Any, path: str) -> None:
        if isinstance(obj, Tensor) or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            return
        if isinstance(obj, (list, tuple)):
            for i, item in enumerate(obj):
                visit(item, f"{path}[{i}]")
        elif isinstance(obj, Mapping):
            for key, value in obj.items():
                visit(value, f"{path}[{key!r}]")
        elif (dataclasses.is_dataclass(obj) and not isinstance(obj, type)) or _is_record(obj):
            return
        elif any(isinstance(v, Tensor) for v in getattr(obj, "__dict__", {}).values()):
            found.append(path)

    visit(batch, ROOT)
    return found
