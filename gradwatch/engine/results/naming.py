"""Module names as a reader types them: ``net[2]`` for the third child of an ``nn.Sequential`` or ``nn.ModuleList``
(``named_modules()`` spells it ``net.2``), ``<model>`` for the model itself (``named_modules()`` spells it ``""``).

The names a report keeps for code (:attr:`~gradwatch.engine.results.report.CheckReport.culprits`, a probe's
``target``) stay those of ``named_modules()``, which ``model.get_submodule`` takes; only the words shown to a reader
(the culprit message) use these.
"""

from __future__ import annotations

MODEL_NAME = "<model>"
"""How the model itself is named to a reader."""


def display_name(name: str) -> str:
    """``name`` (as in ``named_modules()``) as a reader types it: each all-digit part an index (``blocks.0.norm`` ->
    ``blocks[0].norm``, ``net.2`` -> ``net[2]``; a child of a model that is itself a ``Sequential``, ``2`` ->
    ``<model>[2]``), ``""`` -> :data:`MODEL_NAME`."""
    if not name:
        return MODEL_NAME
    parts = name.split(".")
    shown = MODEL_NAME if parts[0].isdigit() else parts.pop(0)
    for part in parts:
        shown += f"[{part}]" if part.isdigit() else f".{part}"
    return shown


def named_module(name: str, kind: str) -> str:
    """A module named with its class, in backticks: ``\\`net[2]\\` (\\`Linear\\`)``."""
    return f"`{display_name(name)}` (`{kind}`)"
