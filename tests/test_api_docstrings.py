"""Every parameter of the public API has its row in the API reference's parameter tables.

The API reference (``docs/api.md``, mkdocstrings) makes a table of each docstring's ``Args:`` (``Keyword Args:``,
``Attributes:`` for a dataclass's fields) section; a parameter left out of it is a parameter the site does not
explain. The sources are read with :mod:`ast`, as mkdocstrings reads them: no import of Lightning, transformers or
DeepSpeed, whose modules are documented too.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

import gradwatch

ROOT = Path(__file__).resolve().parents[1]

# the modules the API reference documents, each with its __all__ (docs/api.md)
MODULES = ["gradwatch", "gradwatch.integrations.huggingface", "gradwatch.integrations.deepspeed", "gradwatch.testing"]

_SECTION = re.compile(r"^(?P<indent> *)(Args|Arguments|Keyword Args|Other Parameters|Attributes):\s*$")
_ENTRY = re.compile(r"^\**(?P<name>\w+)\s*(\([^)]*\))?:")


def _path(module: str) -> Path:
    base = ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(_path(module).read_text())


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if _path(module).name == "__init__.py" else module.split(".")[:-1]
    package = package[: len(package) - node.level + 1]
    return ".".join([*package, *([node.module] if node.module else [])])


def _definition(module: str, name: str) -> tuple[str, ast.ClassDef | ast.FunctionDef] | None:
    """Where ``name`` of ``module`` is defined, following re-exports within gradwatch; ``None`` outside it."""
    for node in ast.walk(_tree(module)):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name and node.col_offset == 0:
            return module, node
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.ImportFrom) and any(alias.name == name for alias in node.names):
            source = _absolute(module, node)
            if source.split(".")[0] == "gradwatch":
                return _definition(source, name)
    return None


def _exported(module: str) -> list[str]:
    for node in _tree(module).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [element.value for element in node.value.elts]  # type: ignore[attr-defined]
    raise AssertionError(f"{module} has no __all__")


def _documented(docstring: str | None) -> set[str]:
    """The names of the entries of a Google-style docstring's parameter and attribute sections."""
    names: set[str] = set()
    indent: int | None = None
    for line in (docstring or "").expandtabs().splitlines():
        if (section := _SECTION.match(line)) is not None:
            indent = len(section["indent"])
            continue
        if indent is None or not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth <= indent:
            indent = None
        elif depth == indent + 4 and (entry := _ENTRY.match(line.strip())) is not None:
            names.add(entry["name"])
    return names


def _parameters(function: ast.FunctionDef) -> list[str]:
    arguments = function.args
    names = [a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]]
    names += [a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None]
    return [name for name in names if name not in {"self", "cls"}]


def _is_property(function: ast.FunctionDef) -> bool:
    return any(getattr(d, "id", getattr(d, "attr", None)) in {"property", "setter"} for d in function.decorator_list)


def _keyword_only_sentinel(statement: ast.AnnAssign) -> bool:
    """Whether ``statement`` is a dataclass's ``_: KW_ONLY`` line, which marks the fields after it keyword-only and is
    no field itself."""
    annotation = statement.annotation
    return getattr(annotation, "id", getattr(annotation, "attr", None)) == "KW_ONLY"


def _classes(module: str, cls: ast.ClassDef) -> list[ast.ClassDef]:
    """The class and its bases defined in gradwatch (their members are rendered as its own)."""
    found = [cls]
    for base in cls.bases:
        defined = _definition(module, base.id) if isinstance(base, ast.Name) else None
        if defined is not None and isinstance(defined[1], ast.ClassDef):
            found += _classes(*defined)  # type: ignore[arg-type]
    return found


def _cases() -> list[tuple[str, list[str], set[str]]]:
    """(the object's path, its parameters, the names its docstring documents) for each public object and method."""
    cases = []
    for module in MODULES:
        for name in _exported(module):
            defined = _definition(module, name)
            if defined is None:  # a constant
                continue
            where, node = defined
            path = f"{module}.{name}"
            if isinstance(node, ast.FunctionDef):
                cases.append((path, _parameters(node), _documented(ast.get_docstring(node))))
                continue
            members = [m for c in _classes(where, node) for m in c.body if isinstance(m, ast.FunctionDef)]
            init = next((m for m in members if m.name == "__init__"), None)
            fields = [
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and not _keyword_only_sentinel(s)
            ]
            cases.append((path, _parameters(init) if init else fields, _documented(ast.get_docstring(node))))
            for method in members:
                docstring = ast.get_docstring(method)
                if method.name.startswith("_") or _is_property(method) or not docstring:
                    continue
                cases.append((f"{path}.{method.name}", _parameters(method), _documented(docstring)))
    return cases


CASES = _cases()


def test_the_public_api_is_found() -> None:
    paths = {path for path, _, _ in CASES}
    assert {f"gradwatch.{name}" for name in gradwatch.__all__} <= paths
    assert {"gradwatch.integrations.huggingface.GradWatchCallback", "gradwatch.GradientWatch.record"} <= paths


@pytest.mark.parametrize(("path", "parameters", "documented"), CASES, ids=[path for path, _, _ in CASES])
def test_each_parameter_has_its_entry_in_the_docstring(path: str, parameters: list[str], documented: set[str]) -> None:
    missing = [name for name in parameters if name not in documented]
    assert not missing, f"{path}: parameters without an entry in its docstring's Args: {missing}"


def test_the_docstring_reader_finds_args_and_stops_at_the_next_section() -> None:
    docstring = (
        "Summary.\n\nArgs:\n    first: One.\n        More of it.\n    **rest: Others.\n\nReturns:\n    value: no\n"
    )
    assert _documented(docstring) == {"first", "rest"}
