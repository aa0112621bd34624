"""Which parameters a check probes: every trainable floating parameter but those ``ignore=`` exempts and those whose
gradient is deliberately not the derivative by design (:mod:`gradwatch.engine.function.surrogates`).

An ``ignore=`` pattern that matches no parameter is almost always a pattern written against other names than the
model's (``"encoder.*"`` for a LightningModule whose parameters are ``model.encoder.…``); it would silently exempt
nothing. :func:`unmatched_patterns` says so, with the names it was probably meant for.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Collection, Sequence
from typing import Any

from torch import Tensor, nn

from gradwatch.engine.function.batch import floating_tensors
from gradwatch.engine.function.complex_params import checked_view
from gradwatch.engine.results.notes import Note, NoteCode


def checked_parameters(
    model: nn.Module, ignore: Sequence[str], unprobed: Collection[str] = ()
) -> list[tuple[str, Tensor]]:
    """The parameters of ``model`` a check probes, by name: trainable, floating or complex (as its real view, see
    :mod:`gradwatch.engine.function.complex_params`), not matched by a pattern of ``ignore`` and not in ``unprobed``."""
    return [
        (name, checked_view(p))
        for name, p in model.named_parameters()
        if p.requires_grad
        and (p.is_floating_point() or p.is_complex())
        and not any(fnmatch.fnmatchcase(name, pattern) for pattern in ignore)
        and name not in unprobed
    ]


def unmatched_patterns(patterns: Sequence[str], names: Sequence[str], argument: str = "ignore") -> list[str]:
    """A message for each of ``patterns`` that matches none of the parameter ``names``, with the closest names."""
    messages = []
    for pattern in patterns:
        if any(fnmatch.fnmatchcase(name, pattern) for name in names):
            continue
        suggestions = _prefixed(pattern, names) or difflib.get_close_matches(pattern, names, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(repr(s) for s in suggestions)}?" if suggestions else ""
        example = f" (they read like {names[0]!r})" if names and not suggestions else ""
        messages.append(f"`{argument}` pattern {pattern!r} matches no parameter of the model{example}{hint}")
    return messages


def _prefixed(pattern: str, names: Sequence[str]) -> list[str]:
    """``pattern`` behind the module prefixes under which it would match (``"model.encoder.*"`` for ``"encoder.*"``)."""
    found: list[str] = []
    for name in names:
        parts = name.split(".")
        for depth in range(1, len(parts)):
            candidate = ".".join(parts[:depth]) + "." + pattern
            if fnmatch.fnmatchcase(name, candidate) and candidate not in found:
                found.append(candidate)
                break
        if len(found) == 3:
            break
    return found


def refuse_meta(model: nn.Module, batch: Any) -> None:
    """A model or batch on the ``meta`` device has no values to evaluate: say so before torch does, in its words."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    meta = next((name for name, tensor in tensors if tensor.is_meta), None)
    if meta is not None:
        raise ValueError(
            "`model` must hold real tensors to be checked; got a model on the meta device (its tensor "
            f"{meta!r} has a shape but no values): materialise it first, e.g. model.to_empty(device='cpu') and load "
            "its weights"
        )
    meta = next((path for path, tensor in floating_tensors(batch).items() if tensor.is_meta), None)
    if meta is not None:
        raise ValueError(f"`batch` must hold real tensors; got a meta tensor at {meta} (a shape without values)")


def known_focus(focus: tuple[str, ...], model: nn.Module) -> tuple[tuple[str, ...], list[Note]]:
    """The names of ``focus`` that name parameters of the model, and a note on the others (a checkpoint from a
    renamed layer): they are dropped, never the check."""
    names = {name for name, _ in model.named_parameters()}
    unknown = [name for name in focus if name not in names]
    if not unknown:
        return focus, []
    note = Note(
        NoteCode.FOCUS_UNKNOWN,
        f"`focus` named {unknown}, which the model has no parameter of (renamed or removed?): left out",
    )
    return tuple(name for name in focus if name in names), [note]
