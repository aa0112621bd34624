"""No function in gradwatch takes more than six positional parameters, and no record's generated ``__init__`` more than
six positional fields: past six, a caller cannot tell which value lands in which slot (a past ``gradcheck`` passed
``atol`` into ``rtol``'s), so the rest are keyword-only (``*`` in a signature, ``_: KW_ONLY`` or ``kw_only=True`` in a
dataclass). An AST walk over the package's sources, so that it sees every function, nested ones included."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gradwatch"

LIMIT = 6
"""The most positional parameters a function (``self``/``cls`` not counted) or a record's ``__init__`` may take."""


def _tail(node: ast.expr) -> str:
    """The last name of a dotted expression (``dataclasses.dataclass`` -> ``"dataclass"``), ``""`` for anything else."""
    if isinstance(node, ast.Call):
        return _tail(node.func)
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Subscript):
        return _tail(node.value)
    return ""


def _keyword_true(call: ast.expr, name: str) -> bool:
    """Whether ``call`` is a call passing ``name=True``."""
    return isinstance(call, ast.Call) and any(
        keyword.arg == name and isinstance(keyword.value, ast.Constant) and keyword.value.value is True
        for keyword in call.keywords
    )


def _keyword_false(call: ast.expr, name: str) -> bool:
    """Whether ``call`` is a call passing ``name=False``."""
    return isinstance(call, ast.Call) and any(
        keyword.arg == name and isinstance(keyword.value, ast.Constant) and keyword.value.value is False
        for keyword in call.keywords
    )


@dataclass(frozen=True)
class _Record:
    """A dataclass or NamedTuple of the package: where it is, its bases' names, and its own ``__init__`` fields."""

    where: str
    bases: tuple[str, ...]
    positional: int
    """Its own fields that ``__init__`` takes positionally."""
    keyword_only: bool
    """Whether the whole class is ``kw_only=True``."""


def _record(node: ast.ClassDef, where: str) -> _Record | None:
    """The record that class ``node`` declares, or ``None`` when it is neither a dataclass nor a NamedTuple."""
    decorators = [decorator for decorator in node.decorator_list if _tail(decorator) == "dataclass"]
    named_tuple = any(_tail(base) == "NamedTuple" for base in node.bases)
    if not decorators and not named_tuple:
        return None
    if decorators and _keyword_false(decorators[0], "init"):
        return None
    keyword_only = bool(decorators) and _keyword_true(decorators[0], "kw_only")
    positional = 0
    for statement in node.body:
        if not isinstance(statement, ast.AnnAssign) or not isinstance(statement.target, ast.Name):
            continue
        annotation = _tail(statement.annotation)
        if annotation == "KW_ONLY":
            break
        if annotation == "ClassVar":
            continue
        value = statement.value
        if (
            value is not None
            and _tail(value) == "field"
            and (_keyword_false(value, "init") or _keyword_true(value, "kw_only"))
        ):
            continue
        positional += 1
    bases = tuple(_tail(base) for base in node.bases)
    return _Record(where, bases, positional, keyword_only)


def _positional(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The positional parameters of function ``node``: positional-only and regular, ``self``/``cls`` not counted."""
    names = [argument.arg for argument in (*node.args.posonlyargs, *node.args.args)]
    if names and names[0] in ("self", "cls", "mcs"):
        names = names[1:]
    return len(names)


def offenders(package: Path = PACKAGE) -> list[str]:
    """Every function and record under ``package`` past :data:`LIMIT`, as ``"path:line name (count)"``."""
    found: list[str] = []
    records: dict[str, list[_Record]] = {}
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package.parent)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                count = _positional(node)
                if count > LIMIT:
                    found.append(f"{relative}:{node.lineno} {node.name} ({count} positional parameters)")
            elif isinstance(node, ast.ClassDef):
                record = _record(node, f"{relative}:{node.lineno} {node.name}")
                if record is not None:
                    records.setdefault(node.name, []).append(record)

    def fields(record: _Record, seen: frozenset[str]) -> int:
        """The positional fields of ``record``'s ``__init__``: its bases' (records of the package) before its own."""
        inherited = 0
        for base in record.bases:
            for parent in records.get(base, []) if base not in seen else []:
                inherited += fields(parent, seen | {base})
                break
        return inherited + (0 if record.keyword_only else record.positional)

    for name, declared in records.items():
        for record in declared:
            count = fields(record, frozenset({name}))
            if count > LIMIT:
                found.append(f"{record.where} ({count} positional fields in __init__)")
    return found


def test_no_function_takes_more_than_six_positional_parameters() -> None:
    found = offenders()
    assert not found, "past six positional parameters, make the rest keyword-only:\n" + "\n".join(found)


def test_the_walk_counts_what_it_should(tmp_path: Path) -> None:
    """The counting rules on a small source: ``self`` is not counted, ``*`` and ``KW_ONLY`` end the positional ones."""
    source = """
from dataclasses import KW_ONLY, dataclass, field
def seven(a, b, c, d, e, f, g): ...
def six_then_keywords(a, b, c, d, e, f, *, g, h): ...
class C:
    def method(self, a, b, c, d, e, f): ...
@dataclass
class Seven:
    a: int; b: int; c: int; d: int; e: int; f: int; g: int
@dataclass
class Sentinel:
    a: int; b: int; c: int; d: int; e: int; f: int
    _: KW_ONLY
    g: int
@dataclass(kw_only=True)
class AllKeywords:
    a: int; b: int; c: int; d: int; e: int; f: int; g: int
@dataclass
class Derived(Sentinel):
    h: int
"""
    tree = ast.parse(source)
    functions = {node.name: _positional(node) for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert functions == {"seven": 7, "six_then_keywords": 6, "method": 6}
    classes = {node.name: _record(node, node.name) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    assert {name: (record.positional if record else None) for name, record in classes.items()} == {
        "C": None, "Seven": 7, "Sentinel": 6, "AllKeywords": 7, "Derived": 1
    }  # fmt: skip
    (tmp_path / "package").mkdir()
    (tmp_path / "package" / "module.py").write_text(source)
    assert [line.split(" ", 1)[1] for line in offenders(tmp_path / "package")] == [
        "seven (7 positional parameters)",
        "Seven (7 positional fields in __init__)",
        "Derived (7 positional fields in __init__)",
    ]
