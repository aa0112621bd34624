"""Griffe extension of the API reference: ``**options: Unpack[ProbeOptions]`` shown as the options it stands for.

The probe options are declared once, as the fields of ``ProbeSettings`` (their defaults, and their documentation in its
``Args:``), and the watch's options once, in ``GradientWatch``'s signature and docstring; every other entry point takes
them as ``**options`` typed by a ``TypedDict`` of their names (``ProbeOptions``, ``WatchOptions``). So that the
reference of each entry point still lists every option with its default and its meaning, each such ``**options`` gets,
in front of it, a keyword-only parameter per option, with the default and annotation of the declaration, and a row in
the parameters table with its text. Nothing is written twice in the sources.
"""

from __future__ import annotations

from typing import Any

import griffe

OPTIONS = {
    "gradwatch.engine.settings.ProbeOptions": ("gradwatch.engine.settings.ProbeSettings",),
    "gradwatch.watch.options.WatchOptions": (
        "gradwatch.watch.watch.GradientWatch",
        "gradwatch.engine.settings.ProbeSettings",
    ),
}
"""Each ``TypedDict`` that types an entry point's ``**options``, and the classes that declare its keys, in order:
the parameters of their ``__init__`` (a dataclass's fields) and the entries of their docstring's ``Args:``."""


def _documented(docstring: griffe.Docstring | None) -> dict[str, griffe.DocstringParameter]:
    """The entries of a docstring's parameter sections, by name: parsed apart, as the docstring's own parse (cached)
    is the API reference's, to be made once the dataclasses have their ``__init__``."""
    if docstring is None:
        return {}
    parsed = griffe.parse(docstring, docstring.parser or "google", warnings=False)
    sections = [s for s in parsed if isinstance(s, griffe.DocstringSectionParameters)]
    return {entry.name: entry for section in sections for entry in section.value}


def _declared(cls: griffe.Class) -> dict[str, tuple[griffe.Parameter, griffe.DocstringParameter | None]]:
    """The keyword parameters of a class's ``__init__`` (a dataclass's fields, which griffe makes its ``__init__`` of
    only after this extension has run) with their docstring entries."""
    entries = _documented(cls.docstring)
    init = cls.members.get("__init__")
    if isinstance(init, griffe.Function):
        entries = {**_documented(init.docstring), **entries}
        kinds = {griffe.ParameterKind.keyword_only, griffe.ParameterKind.positional_or_keyword}
        parameters = [p for p in init.parameters if p.kind in kinds and p.name != "self"]
    else:
        fields = [m for m in cls.members.values() if isinstance(m, griffe.Attribute) and m.annotation is not None]
        parameters = [griffe.Parameter(f.name, annotation=f.annotation, default=f.value) for f in fields]
    return {p.name: (p, entries.get(p.name)) for p in parameters}


def _keys(typed: griffe.Class) -> list[str]:
    """The keys of a ``TypedDict``, its own first, then its bases'."""
    own = [name for name, member in typed.members.items() if member.is_attribute]
    inherited = [name for name, member in typed.inherited_members.items() if member.is_attribute]
    return [*own, *(name for name in inherited if name not in own)]


class SpelledOutOptions(griffe.Extension):
    """Spell out the options an entry point takes as ``**options: Unpack[...]`` (see the module doc)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "gradwatch":
            return
        collection = loader.modules_collection
        options: dict[str, list[tuple[str, griffe.Parameter, griffe.DocstringParameter | None]]] = {}
        for typed_path, sources in OPTIONS.items():
            declared: dict[str, tuple[griffe.Parameter, griffe.DocstringParameter | None]] = {}
            for source in reversed(sources):  # the first source wins
                declared.update(_declared(collection.get_member(source)))
            typed = collection.get_member(typed_path)
            options[typed.name] = [(key, *declared[key]) for key in _keys(typed)]
        self._visit(pkg, options, set())

    def _visit(self, obj: griffe.Object, options: dict[str, Any], seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        for member in list(obj.members.values()):
            if member.is_alias:
                continue
            if member.is_function:
                owner = obj if member.name == "__init__" and obj.is_class else member
                self._spell_out(member, owner, options)  # type: ignore[arg-type]
            if member.is_module or member.is_class:
                self._visit(member, options, seen)  # type: ignore[arg-type]

    @staticmethod
    def _spell_out(func: griffe.Function, owner: griffe.Object, options: dict[str, Any]) -> None:
        """Put each option before ``func``'s ``**options``, and its row after the docstring's ``**options`` entry."""
        catch_all = next((p for p in func.parameters if p.kind is griffe.ParameterKind.var_keyword), None)
        annotation = str(catch_all.annotation) if catch_all is not None else ""
        typed_name = next((name for name in options if annotation == f"Unpack[{name}]"), None)
        if catch_all is None or typed_name is None:
            return
        taken = {p.name for p in func.parameters}
        spelled = [(key, p, entry) for key, p, entry in options[typed_name] if key not in taken]
        position = list(func.parameters).index(catch_all)
        parameters = list(func.parameters)
        parameters[position:position] = [
            griffe.Parameter(key, annotation=p.annotation, kind=griffe.ParameterKind.keyword_only, default=p.default)
            for key, p, _ in spelled
        ]
        func.parameters = griffe.Parameters(*parameters)
        if owner.docstring is None:
            return
        for section in owner.docstring.parsed:
            if not isinstance(section, griffe.DocstringSectionParameters):
                continue
            names = [entry.name.lstrip("*") for entry in section.value]
            if catch_all.name in names:
                at = names.index(catch_all.name) + 1
                section.value[at:at] = [
                    griffe.DocstringParameter(
                        key,
                        description=entry.description if entry is not None else "",
                        annotation=p.annotation,
                        value=p.default,
                    )
                    for key, p, entry in spelled
                ]
