"""The public API and the import paths of gradwatch 0.1 keep working after the package was split into layers."""

from __future__ import annotations

import importlib

import pytest

import gradwatch


def test_the_public_names_are_exported_from_the_package() -> None:
    assert set(gradwatch.__all__) == {
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
    from gradwatch.lightning import GradWatch
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
    ("old", "new", "names"),
    [
        ("gradwatch.callback", "gradwatch.lightning.callback", ["GradWatch"]),
        ("gradwatch.callback", "gradwatch.lightning.publishing", ["progress_status", "PROGRESS_BAR_KEY"]),
        ("gradwatch.callback", "gradwatch.lightning.training_step", ["training_step_loss"]),
        ("gradwatch.check", "gradwatch.engine.check", ["check_gradients"]),
        ("gradwatch.lightning.schedule", "gradwatch.watch.schedule", ["Schedule"]),
        ("gradwatch.lightning.overhead", "gradwatch.watch.overhead", ["OverheadClock"]),
        (
            "gradwatch.lightning.alerts",
            "gradwatch.watch.alerts",
            ["AlertPolicy", "Backoff", "GradientCheckWarning", "Remarks", "failure_message"],
        ),
        ("gradwatch.lightning.training_step", "gradwatch.watch.hooks", ["NoLossToCheckError"]),
        ("gradwatch.report", "gradwatch.engine.report", ["CheckReport", "Probe", "GradientCheckError", "VERDICTS"]),
        (
            "gradwatch.tensorboard",
            "gradwatch.tensorboard.writer",
            ["write_report", "failures_markdown", "FAILURES_TAG"],
        ),
    ],
    ids=[
        "callback",
        "callback-publishing",
        "callback-loss",
        "check",
        "schedule",
        "overhead",
        "alerts",
        "no-loss",
        "report",
        "tensorboard",
    ],
)
def test_old_import_paths_give_the_same_objects(old: str, new: str, names: list[str]) -> None:
    before, now = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(before, name) is getattr(now, name), name


def test_the_command_line_entry_point_is_where_the_package_metadata_says() -> None:
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "gradwatch"]
    assert script.value == "gradwatch.cli:main"
    assert callable(script.load())
