"""PyTorch's own warnings that a gradient may be silently incorrect (an operator without an autograd kernel, which
autograd backpropagates through as the identity) become a note of the check naming the operator, even where training
has shown the warning already; where the gradient is then wrong, the check fails."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from public_bug_models import (
    all_reduced_loss,
    loss_through_unregistered_operator,
    regression_batch,
    regression_mlp,
)
from two_processes import needs_gloo, run_launched

from gradwatch import check_gradients
from gradwatch.engine.function.torch_warnings import incorrect_gradient_notes, torch_registries_cleared
from gradwatch.engine.results.notes import NoteCode


@pytest.fixture
def single_process_group(tmp_path: Path) -> Iterator[None]:
    """A gloo group of one process on a file store: enough for ``all_reduce`` to run, and warn."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _train_once(model: torch.nn.Module, batch: object, loss_fn: object) -> None:
    """Training's own backward first, which shows PyTorch's warning (once per place, as Python does)."""
    loss_fn(model, batch).backward()  # type: ignore[operator]
    model.zero_grad()


def test_a_plain_all_reduce_in_the_loss_is_reported_with_its_operator(single_process_group: None) -> None:
    model, batch = regression_mlp(), regression_batch()
    _train_once(model, batch, all_reduced_loss)
    report = check_gradients(model, batch, all_reduced_loss)
    (note,) = report.noted(NoteCode.SILENTLY_INCORRECT)
    assert "`c10d::allreduce_`" in note
    # one process: the all-reduce is the identity, so is its gradient, and the check has nothing to fail
    assert report.verdict == "ok", str(report)


def test_an_operator_without_autograd_whose_gradient_is_wrong_fails_with_the_note() -> None:
    model, batch = regression_mlp(), regression_batch()
    _train_once(model, batch, loss_through_unregistered_operator)
    report = check_gradients(model, batch, loss_through_unregistered_operator)
    (note,) = report.noted(NoteCode.SILENTLY_INCORRECT)
    assert "`gradwatch_public_bugs::halve_`" in note
    assert report.verdict == "fail", str(report)
    assert report.descent_ratio == pytest.approx(0.5, rel=1e-3)  # twice the derivative


def test_a_healthy_loss_gets_no_such_note() -> None:
    def plain_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    report = check_gradients(regression_mlp(), regression_batch(), plain_loss)
    assert report.noted(NoteCode.SILENTLY_INCORRECT) == []
    assert report.verdict == "ok", str(report)


def test_the_registries_are_put_back_as_they_were() -> None:
    import torch.autograd.graph as graph

    registry = graph.__dict__.setdefault("__warningregistry__", {})
    before = dict(registry)
    registry[("planted", UserWarning, 1)] = True
    with torch_registries_cleared():
        assert ("planted", UserWarning, 1) not in graph.__dict__["__warningregistry__"]
        graph.__dict__["__warningregistry__"][("new", UserWarning, 2)] = True
    after = graph.__dict__["__warningregistry__"]
    assert after[("planted", UserWarning, 1)] is True
    assert ("new", UserWarning, 2) not in after
    del after[("planted", UserWarning, 1)]
    assert after == before


def test_a_module_imported_after_the_last_check_has_its_registry_emptied_and_put_back_too() -> None:
    import sys
    import types

    with torch_registries_cleared():  # the modules' namespaces read once, as by an earlier check
        pass
    late = types.ModuleType("torch._gradwatch_imported_late")  # imported after: the list is read again
    late.__dict__["__warningregistry__"] = {("planted", UserWarning, 1): True}
    sys.modules[late.__name__] = late
    try:
        with torch_registries_cleared():
            assert late.__dict__["__warningregistry__"] == {}
            late.__dict__["__warningregistry__"][("new", UserWarning, 2)] = True
        assert late.__dict__["__warningregistry__"] == {("planted", UserWarning, 1): True}
    finally:
        del sys.modules[late.__name__]


def test_a_check_without_warnings_puts_back_the_registries_it_emptied() -> None:
    import torch.autograd.graph as graph

    registry = graph.__dict__.setdefault("__warningregistry__", {})
    registry[("planted", UserWarning, 3)] = True
    before = dict(registry)
    with torch_registries_cleared(warned=lambda: False):
        assert graph.__dict__["__warningregistry__"] == {}
    assert graph.__dict__["__warningregistry__"] == before
    del registry[("planted", UserWarning, 3)]


def test_a_torch_module_imported_since_the_last_check_has_its_registry_emptied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import types

    with torch_registries_cleared():  # the modules known now
        pass
    module = types.ModuleType("torch.gradwatch_planted_module")
    module.__dict__["__warningregistry__"] = {("planted", UserWarning, 4): True}
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with torch_registries_cleared():
        assert module.__dict__["__warningregistry__"] == {}
    assert module.__dict__["__warningregistry__"] == {("planted", UserWarning, 4): True}


def test_warnings_of_other_kinds_are_quoted_and_unrelated_ones_ignored() -> None:
    notes = incorrect_gradient_notes(
        [
            "UserWarning: mylib::op: an autograd kernel was not registered to the Autograd key(s) but ...",
            "UserWarning: mylib::op: an autograd kernel was not registered to the Autograd key(s) but ...",
            "UserWarning: this may lead to silently incorrect gradients. Use X instead",
            "UserWarning: Batching rule not implemented for aten::foo",
        ]
    )
    assert [n.code for n in notes] == [NoteCode.SILENTLY_INCORRECT] * 2
    assert "`mylib::op`" in notes[0]
    assert "silently incorrect gradients" in notes[1]


@needs_gloo
@pytest.mark.slow
def test_a_plain_all_reduce_across_two_ranks_is_reported_and_its_wrong_gradient_caught(tmp_path: Path) -> None:
    found = run_launched("all_reduce_loss_run.py", tmp_path, "all_reduce", "autograd_all_reduce", timeout_s=240)[0]
    for rank in (0, 1):
        plain, autograd = found[f"all_reduce_rank{rank}"], found[f"autograd_all_reduce_rank{rank}"]
        assert plain["verdict"] == "fail", plain["report"]
        assert plain["descent_ratio"] == pytest.approx(2.0, rel=1e-3), plain["report"]  # this rank's term alone
        assert any("`c10d::allreduce_`" in note for note in plain["silently_incorrect"]), plain["report"]
        assert autograd["verdict"] == "ok", autograd["report"]
        assert autograd["silently_incorrect"] == [], autograd["report"]
