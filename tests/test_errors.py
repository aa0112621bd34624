"""``gradwatch.errors``: every exception and warning in one module, each still importable where it was defined before;
and :func:`~gradwatch.errors.own_error`, which lets a bug of gradwatch's own through the places that turn the user's
failures into notes."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from applied_models import MLP, batch_for, cross_entropy, train_window
from helpers import DropoutBatchNormNet, SeedModel, classification_batch, cross_entropy_loss, seed_batch, seed_loss

import gradwatch
from gradwatch import check_gradients, errors
from gradwatch.engine.applied import probes
from gradwatch.engine.culprits import search
from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.results.notes import NoteCode

PACKAGE = Path(gradwatch.__file__).resolve().parent

OLD_PATHS = {
    "CheckAbandonedError": "gradwatch.engine.results.report",
    "CheckOutOfMemoryError": "gradwatch.engine.function.memory",
    "ExhaustedError": "gradwatch.engine.culprits.activations",
    "GradientCheckError": "gradwatch.engine.results.report",
    "GradientCheckWarning": "gradwatch.watch.alerts",
    "HeldValuesError": "gradwatch.engine.function.held",
    "InputsRefusedError": "gradwatch.engine.measuring.points",
    "LossCallsBackwardError": "gradwatch.engine.function.backward",
    "NoLossToCheckError": "gradwatch.watch.hooks",
    "NotReproducibleError": "gradwatch.engine.applied.window_points",
    "OutsideTreeError": "gradwatch.engine.function.substitution",
    "PeerFailureError": "gradwatch.engine.distributed.collective",
    "RaisedOnAnotherRankError": "gradwatch.watch.distributed",
    "ReplayError": "gradwatch.engine.update.replay",
    "RestoreError": "gradwatch.engine.function.sandbox",
    "UnfaithfulFloat64Error": "gradwatch.engine.recomputed.faithfulness",
    "UnrestoredStateWarning": "gradwatch.engine.results.report",
    "UnsupportedShardingError": "gradwatch.engine.distributed.parameters",
}
"""Where each class was defined before ``gradwatch.errors``: its import path there keeps working."""


@pytest.mark.parametrize(("name", "module"), OLD_PATHS.items(), ids=OLD_PATHS.keys())
def test_every_old_import_path_gives_the_class_of_errors(name: str, module: str) -> None:
    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


def test_the_package_exports_its_public_ones_from_errors() -> None:
    assert gradwatch.GradientCheckError is errors.GradientCheckError
    assert gradwatch.GradientCheckWarning is errors.GradientCheckWarning


def test_no_other_module_defines_an_exception_or_warning() -> None:
    """Private signals of one module (a leading underscore) aside."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {ast.unparse(base) for base in node.bases}
                named = any(base.endswith(("Error", "Exception", "Warning")) for base in bases)
                if named:
                    found[name] = node.name
    assert not found, found


def _caught_in_gradwatch(raiser: Callable[[], Any]) -> BaseException:
    """The error ``raiser`` raises, caught by a function whose code is gradwatch's (as a check catches it)."""
    namespace: dict[str, Any] = {}
    source = "def catch(call):\n    try:\n        call()\n    except Exception as error:\n        return error\n"
    exec(compile(source, str(PACKAGE / "engine" / "culprits" / "search.py"), "exec"), namespace)
    return namespace["catch"](raiser)


def _gradwatch_function(source: str, name: str) -> Callable[..., Any]:
    """A function whose code sits in gradwatch's own files, as a bug there would."""
    namespace: dict[str, Any] = {}
    exec(compile(source, str(PACKAGE / "engine" / "culprits" / "sites.py"), "exec"), namespace)
    return namespace[name]


def test_an_attribute_error_in_gradwatchs_code_is_its_own() -> None:
    broken = _gradwatch_function("def broken():\n    return None.no_such_attribute\n", "broken")
    assert errors.own_error(_caught_in_gradwatch(broken))


def _users_loss() -> None:
    raise AttributeError("the user's model has no such attribute")


def test_the_users_errors_are_not_gradwatchs_own() -> None:
    assert not errors.own_error(_caught_in_gradwatch(_users_loss))  # raised in the user's code
    calls_user = _gradwatch_function("def calls(user):\n    return user()\n", "calls")
    assert not errors.own_error(_caught_in_gradwatch(lambda: calls_user(_users_loss)))  # through gradwatch
    value = _gradwatch_function("def refuse():\n    raise ValueError('a tensor torch refuses')\n", "refuse")
    assert not errors.own_error(_caught_in_gradwatch(value))  # not a programming error


def test_a_bug_of_gradwatchs_own_in_the_culprit_search_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing check's culprit search turns the loss refusing hooks into a note; a bug of gradwatch's own there is not
    the loss refusing: it propagates out of the check (the watch's guard still keeps a run going)."""
    broken = _gradwatch_function(
        "def trace_sites(model, evaluator):\n    return model.no_such_attribute\n", "trace_sites"
    )
    monkeypatch.setattr(search, "trace_sites", broken)
    with pytest.raises(AttributeError, match="no_such_attribute"):
        check_gradients(SeedModel(weight_scale=1.1), seed_batch(), seed_loss)


def test_the_loss_refusing_hooks_in_the_culprit_search_is_still_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    def refusing(model: Any, evaluator: Any) -> None:  # the user's code raising, as a loss refusing hooks does
        raise AttributeError("the loss's model has no such attribute")

    monkeypatch.setattr(search, "trace_sites", refusing)
    report = check_gradients(SeedModel(weight_scale=1.1), seed_batch(), seed_loss)
    assert report.verdict == "fail"
    assert any("no culprit search: the loss cannot run with hooks on its modules" in str(note) for note in report.notes)


def _vectorised_check() -> Any:
    torch.manual_seed(0)
    return check_gradients(DropoutBatchNormNet(), classification_batch(), cross_entropy_loss, probe_batch_size=4)


def test_a_bug_of_gradwatchs_own_in_a_vectorised_pass_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loss that vmap cannot run is evaluated point by point, with a note; a bug of gradwatch's own in the vectorised
    pass is not the loss refusing vmap: it propagates out of the check."""
    assert _vectorised_check().vectorized is True  # the model vectorises: the planted bug is reached
    broken = _gradwatch_function(
        "def losses(self, params, inputs, points):\n    return self.no_such_attribute\n", "losses"
    )
    monkeypatch.setattr(LossEvaluator, "losses", broken)
    with pytest.raises(AttributeError, match="no_such_attribute"):
        _vectorised_check()


def test_the_loss_refusing_vmap_is_still_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    def refusing(self: Any, params: Any, inputs: Any, points: int) -> None:  # the user's code raising under vmap
        raise AttributeError("the loss's model has no such attribute under vmap")

    monkeypatch.setattr(LossEvaluator, "losses", refusing)
    report = _vectorised_check()
    assert report.verdict == "ok", str(report)
    assert report.vectorized is False
    assert report.noted(NoteCode.NOT_VECTORISABLE), report.notes


def _applied_check() -> Any:
    torch.manual_seed(0)
    model = MLP()
    return train_window(model, [batch_for(model, seed=1), batch_for(model, seed=2)]).check(cross_entropy)


def test_a_bug_of_gradwatchs_own_in_the_applied_probes_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    """The applied check probes natively when the model cannot run in float64, with a note; a bug of gradwatch's own
    there is not the model refusing float64: it propagates out of the check."""
    broken = _gradwatch_function(
        "def float64_storage(model, moved=None):\n    return model.no_such_attribute\n", "float64_storage"
    )
    monkeypatch.setattr(probes, "float64_storage", broken)
    with pytest.raises(AttributeError, match="no_such_attribute"):
        _applied_check()


def test_the_model_refusing_float64_in_the_applied_probes_is_still_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    def refusing(model: Any, moved: Any = None) -> None:  # the user's model raising in float64
        raise AttributeError("the model has no float64 kernel")

    monkeypatch.setattr(probes, "float64_storage", refusing)
    report = _applied_check()
    assert report.verdict == "ok", str(report)
    assert any("probes run natively: the loss raised AttributeError in float64" in str(note) for note in report.notes)
