"""The public API and the import paths of gradwatch 0.1 keep working after the package was split into layers."""

from __future__ import annotations

import importlib

import pytest

import gradwatch


def test_the_public_names_are_exported_from_the_package() -> None:
    assert set(gradwatch.__all__) == {
        "AppliedFindings",
        "AppliedWindow",
        "CheckReport",
        "GradWatch",
        "GradientCheckError",
        "GradientCheckWarning",
        "GradientWatch",
        "Probe",
        "ProbeSettings",
        "check_applied_gradient",
        "check_gradients",
    }
    from gradwatch.engine import check_gradients
    from gradwatch.integrations.lightning import GradWatch
    from gradwatch.watch import GradientCheckWarning, GradientWatch

    assert gradwatch.check_gradients is check_gradients
    from gradwatch.engine.applied import AppliedWindow, check_applied_gradient

    assert gradwatch.check_applied_gradient is check_applied_gradient
    assert gradwatch.AppliedWindow is AppliedWindow
    assert gradwatch.GradWatch is GradWatch
    assert gradwatch.GradientWatch is GradientWatch
    assert gradwatch.GradientCheckWarning is GradientCheckWarning
    from gradwatch.engine.settings import ProbeSettings

    assert gradwatch.ProbeSettings is ProbeSettings


@pytest.mark.parametrize(
    "old",
    ["gradwatch.callback", "gradwatch.check", "gradwatch.report", "gradwatch.lightning", "gradwatch.engine.check",
     "gradwatch.engine.report", "gradwatch.engine.sharding", "gradwatch.cli.report"],
)  # fmt: skip
def test_the_import_paths_from_before_any_release_are_gone(old: str) -> None:
    """Modules that only re-exported another: one import path per name (see docs/architecture.md)."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_the_command_line_entry_point_is_where_the_package_metadata_says() -> None:
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "gradwatch"]
    assert script.value == "gradwatch.cli:main"
    assert callable(script.load())


def _constructors() -> list[tuple[str, object, int]]:
    """The public entry points, and how many leading parameters each takes positionally (the object checked, its
    batch and loss; everything after is an option)."""
    return [
        ("GradientWatch", gradwatch.GradientWatch.__init__, 1),
        ("GradWatch", gradwatch.GradWatch.__init__, 1),
        ("check_gradients", gradwatch.check_gradients, 3),
        ("check_applied_gradient", gradwatch.check_applied_gradient, 4),
    ]


@pytest.mark.parametrize(("name", "function", "positional"), _constructors(), ids=[c[0] for c in _constructors()])
def test_the_public_constructors_take_their_options_keyword_only(name: str, function: object, positional: int) -> None:
    import inspect

    parameters = list(inspect.signature(function).parameters.values())  # type: ignore[arg-type]
    leading = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert len(leading) <= positional, f"{name} takes options positionally: {leading[positional:]}"
    kinds = {p.kind for p in parameters[len(leading) :]}
    assert kinds <= {inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD}
    assert "settings" in {p.name for p in parameters}


def test_the_engine_and_the_watch_are_imported_without_lightning() -> None:
    """Lightning's import (seconds) is paid only by those who use ``GradWatch``: in a fresh interpreter, the names of
    a plain loop leave ``lightning`` out of ``sys.modules`` (that ``from gradwatch import GradWatch`` then imports it
    is tests/test_layering.py's check)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "from gradwatch import AppliedWindow, GradientWatch, ProbeSettings, check_applied_gradient, check_gradients\n"
        "import gradwatch.testing\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'lightning', 'pytorch_lightning', 'transformers'}))\n"
    )
    root = Path(gradwatch.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}  # this checkout's gradwatch, not an installed one
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert "GradWatch" in gradwatch.__all__
