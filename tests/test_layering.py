"""The engine stays free of Lightning and TensorBoard; adapters sit on top of it, never below."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gradwatch"
ENGINE = [
    "report",
    "batch",
    "state",
    "reductions",
    "evaluation",
    "numerics",
    "precision",
    "probes",
    "sampling",
    "check",
    "vectorized",
    "_validation",
    "testing",
]
ADAPTERS = ["callback", "tensorboard", "dashboard", "alerts", "events", "_demo_models", "demo", "cli", "__main__"]


def _imports(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", ENGINE)
def test_engine_imports_no_framework_and_no_adapter(module: str) -> None:
    imported = _imports(module)
    frameworks = {name for name in imported if name.split(".")[0] in {"lightning", "pytorch_lightning", "tensorboard"}}
    assert not frameworks, f"gradwatch.{module} imports {frameworks}"
    adapters = {name for name in imported if name.removeprefix("gradwatch.") in ADAPTERS}
    assert not adapters, f"gradwatch.{module} imports the adapters {adapters}"


def test_tensorboard_writer_and_alerts_do_not_import_lightning_or_the_callback() -> None:
    for module in ("tensorboard", "dashboard", "alerts"):
        imported = _imports(module)
        assert not {n for n in imported if n.startswith(("lightning", "pytorch_lightning"))}
        assert "gradwatch.callback" not in imported


def test_every_module_is_classified() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules == set(ENGINE) | set(ADAPTERS)
