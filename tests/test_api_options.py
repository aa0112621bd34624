"""The options declared once are listed in full wherever they are taken: the API reference of every entry point that
takes ``**options: Unpack[ProbeOptions]`` (or ``WatchOptions``) shows each option with the default and the text of
its one declaration (``ProbeSettings``' fields, ``GradientWatch``'s signature), as ``docs/griffe_options.py`` makes
it from the sources the site is built from."""

from __future__ import annotations

import ast
import inspect
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from gradwatch import GradientWatch, ProbeSettings
from gradwatch.engine.settings import ProbeOptions
from gradwatch.watch.options import WATCH_OPTIONS, WatchOptions

griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parents[1]

ENTRY_POINTS = {
    "gradwatch.engine.recomputed.check.check_gradients": ProbeOptions,
    "gradwatch.engine.applied.check.check_applied_gradient": ProbeOptions,
    "gradwatch.watch.watch.GradientWatch": ProbeOptions,
    "gradwatch.integrations.lightning.callback.GradWatch": WatchOptions,
    "gradwatch.integrations.huggingface.GradWatchCallback": WatchOptions,
}
"""The public entry points that take options as ``**options``, with the ``TypedDict`` that types them."""


@cache
def _package() -> Any:
    sys.path.insert(0, str(ROOT))
    try:
        from docs.griffe_defaults import ConstantDefaults
        from docs.griffe_options import SpelledOutOptions
    finally:
        sys.path.remove(str(ROOT))
    extensions = griffe.load_extensions(ConstantDefaults(), SpelledOutOptions())
    return griffe.load("gradwatch", search_paths=[str(ROOT)], extensions=extensions, docstring_parser="google")


def _rows(path: str) -> dict[str, Any]:
    """The rows of the entry point's parameters table in the API reference, by name."""
    documented = _package().modules_collection.get_member(path)
    sections = [s for s in documented.docstring.parsed if isinstance(s, griffe.DocstringSectionParameters)]
    return {row.name: row for section in sections for row in section.value}


def _default(name: str) -> object:
    """The one declared default of an option: a probe option's field, else the watch's keyword."""
    if name in ProbeSettings.option_names():
        return getattr(ProbeSettings(), name)
    return inspect.signature(GradientWatch.__init__).parameters[name].default


def test_the_adapters_options_are_keywords_of_the_watch() -> None:
    keywords = inspect.signature(GradientWatch.__init__).parameters
    assert set(keywords) >= WATCH_OPTIONS
    assert WatchOptions.__optional_keys__ == WATCH_OPTIONS | ProbeOptions.__optional_keys__


@pytest.mark.parametrize(("path", "typed"), ENTRY_POINTS.items(), ids=[p.rsplit(".", 1)[1] for p in ENTRY_POINTS])
def test_each_option_has_its_row_with_its_declared_default_and_text(path: str, typed: type) -> None:
    rows = _rows(path)
    assert "**options" in rows
    for name in typed.__optional_keys__:  # type: ignore[attr-defined]
        assert name in rows, f"{path}: the option {name} has no row in the API reference"
        row = rows[name]
        assert row.description.strip(), f"{path}: the row of {name} has no text"
        assert ast.literal_eval(str(row.value)) == _default(name), f"{path}: {name}'s default"


def test_a_probe_options_row_is_the_text_of_its_field() -> None:
    field_text = _rows("gradwatch.engine.settings.ProbeSettings")["precision"].description
    assert _rows("gradwatch.engine.recomputed.check.check_gradients")["precision"].description == field_text
    assert _rows("gradwatch.integrations.lightning.callback.GradWatch")["precision"].description == field_text
