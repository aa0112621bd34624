"""Griffe extension of the API reference: a default that names a constant is shown as the constant's value.

gradwatch's signatures take their defaults from named constants whose docstrings give the reasons
(``applied_every_n_steps=DEFAULT_APPLIED_EVERY_N_STEPS``); ``help()`` shows the value, but mkdocstrings reads the
source and would print the name. After the package is loaded, each parameter default that is a name (or an attribute
path) resolving to a module-level constant of gradwatch with a literal value (a number, a string, ``None``, a
boolean) is replaced by that value, in the signature and in the parameter table alike. Anything else is left as
written.
"""

from __future__ import annotations

import ast
from typing import Any

import griffe


def _literal(value: object) -> str | None:
    """The constant's value as source text, when it is a literal; else ``None``."""
    text = str(value)
    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    return text


class ConstantDefaults(griffe.Extension):
    """Show the values of the named constants a signature takes its defaults from."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name == "gradwatch":
            self._visit(pkg, loader, set())

    def _visit(self, obj: griffe.Object, loader: griffe.GriffeLoader, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        for member in obj.members.values():
            if member.is_alias:
                continue
            if member.is_function:
                self._resolve_defaults(member, loader)  # type: ignore[arg-type]
            if member.is_module or member.is_class:
                self._visit(member, loader, seen)  # type: ignore[arg-type]

    @staticmethod
    def _resolve_defaults(func: griffe.Function, loader: griffe.GriffeLoader) -> None:
        for parameter in func.parameters:
            default = parameter.default
            if not isinstance(default, (griffe.ExprName, griffe.ExprAttribute)):
                continue
            try:
                target = loader.modules_collection.get_member(default.canonical_path)
                if target.is_alias:
                    target = target.final_target
            except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
                continue
            value = getattr(target, "value", None) if target.is_attribute else None
            text = _literal(value) if value is not None else None
            if text is not None:
                parameter.default = text
