"""The package's layers, tested: the engine imports no Lightning and no TensorBoard, the watch no framework at all,
``import gradwatch`` neither Lightning nor transformers, and every module imports only from its own layer or the layers
below it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gradwatch"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "engine.results", "engine.validation"),
    ("engine.distributed",),
    ("engine.numerics",),
    ("engine.function",),
    ("engine.measuring",),
    ("engine.probing", "engine.settings"),
    ("engine.selection", "engine.session", "engine.culprits", "engine.recomputed", "engine"),
    ("tensorboard",),
    ("outputs",),
    ("watch",),
    ("integrations",),
    ("cli", "testing", "__main__", "gradwatch"),
)
"""Each layer, lowest first, as modules or subpackages of ``gradwatch``; a module may import from its own layer and
those before it. The exceptions and warnings (``errors``) sit lowest, so that any module may raise them. Above the
engine: the TensorBoard files, the outputs (records and sinks), the loop-agnostic watch, then the adapters over the
watch, one per training loop (``integrations``: Lightning, Hugging Face, DeepSpeed). The last layer holds the faces
(command line, test helpers) and the package itself."""

FRAMEWORKS = {
    "lightning", "pytorch_lightning", "tensorboard", "tensorboardX", "transformers", "accelerate", "deepspeed"
}  # fmt: skip


def _name(path: Path) -> str:
    """The module's dotted name below ``gradwatch`` (``"gradwatch"`` for the package's own ``__init__``)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "gradwatch"


MODULES = {_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _layer(name: str) -> int:
    """The position of the layer holding module ``name``: the most specific entry of :data:`LAYERS` containing it."""
    best: tuple[int, int] | None = None
    for position, entries in enumerate(LAYERS):
        for entry in entries:
            contains = name == entry or name.startswith(entry + ".")
            if contains and (best is None or len(entry) > best[1]):
                best = (position, len(entry))
    if best is None:
        raise AssertionError(f"gradwatch.{name} is in no layer of tests/test_layering.py")
    return best[0]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from gradwatch import cli`
    return names


def _gradwatch_imports(path: Path) -> set[str]:
    """The gradwatch modules ``path`` imports, as names below ``gradwatch`` (names that are not modules dropped)."""
    found = set()
    for name in _imports(path):
        if name == "gradwatch":
            found.add("gradwatch")
        elif name.startswith("gradwatch."):
            inner = name.removeprefix("gradwatch.")
            while inner and inner not in MODULES:
                inner = inner.rpartition(".")[0]
            if inner:
                found.add(inner)
    return found


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n == "engine" or n.startswith("engine.")))
def test_engine_imports_no_framework(name: str) -> None:
    frameworks = {n for n in _imports(MODULES[name]) if n.split(".")[0] in FRAMEWORKS}
    assert not frameworks, f"gradwatch.{name} imports {frameworks}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n == "watch" or n.startswith("watch.")))
def test_the_watch_imports_no_framework(name: str) -> None:
    frameworks = {n for n in _imports(MODULES[name]) if n.split(".")[0] in FRAMEWORKS}
    assert not frameworks, f"gradwatch.{name} imports {frameworks}"


def test_importing_gradwatch_imports_neither_lightning_nor_transformers() -> None:
    code = (
        "import sys, gradwatch\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in {'lightning', 'pytorch_lightning', 'transformers'}]\n"
        "assert not loaded, loaded\n"
        "assert gradwatch.GradientWatch is not None\n"
        "from gradwatch import GradWatch  # the Lightning adapter, imported when asked for\n"
        "assert 'lightning' in sys.modules\n"
        "print(gradwatch.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}  # this checkout's gradwatch, not an installed one
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).parent == PACKAGE


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("tensorboard")))
def test_tensorboard_layer_imports_no_lightning(name: str) -> None:
    assert not {n for n in _imports(MODULES[name]) if n.split(".")[0] in {"lightning", "pytorch_lightning"}}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_from_a_layer_above_its_own(name: str) -> None:
    own = _layer(name)
    upward = {
        other
        for other in _gradwatch_imports(MODULES[name])
        if other != "gradwatch" and _layer(other) > own and not name.startswith(other + ".")
    }
    if name != "gradwatch" and _layer(name) < len(LAYERS) - 1:
        assert "gradwatch" not in _gradwatch_imports(MODULES[name]), f"gradwatch.{name} imports the package itself"
    assert not upward, f"gradwatch.{name} (layer {own}) imports {sorted(upward)} from layers above"


def test_every_module_is_in_a_layer() -> None:
    for name in MODULES:
        _layer(name)  # raises for a module no layer holds


LONGER = {"watch.watch": 800}
"""Modules allowed past 400 lines, with their own cap: ``GradientWatch`` is one module whose public surface is its
calls, reports and state (issue 40); ruff's per-function complexity limit (``C901``, ``max-complexity`` in
``pyproject.toml``) bounds its functions instead."""


def test_no_module_is_over_400_lines() -> None:
    lengths = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    long = {name: n for name, n in lengths.items() if n > LONGER.get(name, 400)}
    assert not long, f"modules over their cap (400 lines, or {LONGER}): {long}"


def test_the_engine_defines_check_gradients() -> None:
    tree = ast.parse(MODULES["engine.recomputed.check"].read_text())
    assert "check_gradients" in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


SCHEDULING = {"gradwatch.watch.cadence", "gradwatch.watch.applied", "gradwatch.watch.overhead", "time", "math"}
"""What scheduling code imports: the watch's cadences and clock, and the clock and arithmetic of a schedule."""

ADAPTERS = [name for name in MODULES if name.split(".")[0] == "integrations"]


@pytest.mark.parametrize("name", ADAPTERS)
def test_the_adapters_hold_no_scheduling_code(name: str) -> None:
    """An adapter translates its loop's hooks into the watch's calls: it imports no schedule or clock, and never
    reads the time or does arithmetic on steps with ``%`` (the watch decides when checks run)."""
    tree = ast.parse(MODULES[name].read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not imported & SCHEDULING, f"gradwatch.{name} imports {sorted(imported & SCHEDULING)}"
    modulos = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod)]
    assert not modulos, f"gradwatch.{name} computes a modulo (a cadence?) at lines {modulos}"
