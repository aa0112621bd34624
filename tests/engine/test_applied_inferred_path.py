"""check_applied_gradient on a 16-bit autocast path that no one named: a model that enters ``torch.autocast`` in its own
``forward``, and a loop that runs its forward under autocast without passing ``path=``. Correct gradients conclude ok
(the path's precision is inferred, with a note), a wrong formula still fails as ``"formula"``, a backward wrong only
under autocast as ``"precision"``, and a float32 loop's gradient changed once stays a ``"transient"`` fault."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from applied_models import AutocastOnlyTanh, bf16, scaled_once
from helpers import assert_bit_identical, snapshot
from library_models import ScaledBackward

from gradwatch.engine.applied import AppliedWindow
from gradwatch.engine.function.conditions import autocast_held_off
from gradwatch.engine.results.notes import NoteCode


class Net(nn.Module):
    """Linear, tanh, linear; ``own_autocast``: the forward enters CPU bf16 autocast itself. ``formula``: the tanh's
    backward is that many times the derivative everywhere; ``autocast_fault``: only under autocast."""

    def __init__(self, own_autocast: bool, formula: float = 1.0, autocast_fault: float = 1.0) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 4)
        self.own_autocast, self.formula, self.autocast_fault = own_autocast, formula, autocast_fault

    def forward(self, x: Tensor) -> Tensor:
        with bf16() if self.own_autocast else contextlib.nullcontext():
            h = self.a(x)
            h = torch.tanh(ScaledBackward.apply(h, self.formula)) if self.formula != 1.0 else h
            h = AutocastOnlyTanh.apply(h, self.autocast_fault) if self.autocast_fault != 1.0 else torch.tanh(h)
            return self.b(h).float()


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _window(model: Net, outer: bool, seeds: tuple[int, ...] = (1, 2)) -> AppliedWindow:
    """One window of a plain loop, its forward under bf16 autocast (``outer``) that it does not tell the check of."""
    window = AppliedWindow(model)
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        batch = (torch.randn(32, 16, generator=generator), torch.randint(0, 4, (32,), generator=generator))
        window.record(batch)
        with bf16() if outer else contextlib.nullcontext():
            loss = _loss(model, batch)
        (loss / len(seeds)).backward()
    return window


CASES = ["own-autocast", "outer-autocast-unnamed"]


def _net(case: str, **faults: float) -> Net:
    torch.manual_seed(0)
    return Net(own_autocast=case == "own-autocast", **faults)


@pytest.mark.parametrize("case", CASES)
def test_a_correct_bf16_path_no_one_named_concludes_ok_with_a_note(case: str) -> None:
    model = _net(case)
    window = _window(model, outer=case != "own-autocast")
    before = snapshot(model)
    random_state = torch.get_rng_state()
    report = window.check(_loss)
    assert_bit_identical(before, snapshot(model))  # the replays leave the run as it was
    assert torch.equal(random_state, torch.get_rng_state())
    assert (report.verdict, report.fault) == ("ok", None), str(report)
    inferred = [n for n in report.notes if n.code == NoteCode.APPLIED_PATH_INFERRED]
    assert len(inferred) == 1
    assert "bfloat16" in inferred[0]
    assert any(n.code == NoteCode.APPLIED_FLOOR and "bfloat16 path" in n for n in report.notes)
    if case != "own-autocast":
        assert 'path=lambda: torch.autocast("cpu", dtype=torch.bfloat16)' in inferred[0]


@pytest.mark.parametrize("case", CASES)
def test_a_three_percent_formula_fault_on_such_a_path_still_fails_as_a_formula_fault(case: str) -> None:
    model = _net(case, formula=1.03)
    report = _window(model, outer=case != "own-autocast").check(_loss, culprit_search=False)
    assert (report.verdict, report.fault) == ("fail", "formula"), str(report)
    assert "a.weight" in {p.target for p in report.failures}


@pytest.mark.parametrize("case", CASES)
def test_a_backward_wrong_only_under_autocast_is_a_precision_fault_on_the_inferred_path(case: str) -> None:
    model = _net(case, autocast_fault=1.5)
    report = _window(model, outer=case != "own-autocast").check(_loss)
    assert (report.verdict, report.fault) == ("fail", "precision"), str(report)
    assert any(n.code == NoteCode.APPLIED_PATH_INFERRED for n in report.notes)


def test_a_float32_gradient_changed_once_is_not_taken_for_a_16_bit_path() -> None:
    model = _net("float32")
    with scaled_once(model.a.weight, 1.02):
        window = _window(model, outer=False)
    report = window.check(_loss)
    assert (report.verdict, report.fault) == ("fail", "transient"), str(report)
    assert not any(n.code == NoteCode.APPLIED_PATH_INFERRED for n in report.notes)
    assert any(n.code == NoteCode.APPLIED_FLOOR and "float32 path" in n for n in report.notes)


def test_a_named_float32_path_is_not_second_guessed() -> None:
    """``path=`` given: the check judges that path, inferring nothing (a bf16 gradient then fails against it)."""
    model = _net("float32")
    report = _window(model, outer=True).check(_loss, path=contextlib.nullcontext)
    assert report.verdict == "fail"
    assert not any(n.code == NoteCode.APPLIED_PATH_INFERRED for n in report.notes)


def test_autocast_held_off_says_which_regions_the_code_tried_to_enter() -> None:
    with autocast_held_off() as entered:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not torch.is_autocast_enabled("cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cpu", enabled=False):
            pass
    assert entered == [("cpu", torch.bfloat16)]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # put back as it was
        assert torch.is_autocast_enabled("cpu")


def test_a_window_recorded_inside_autocast_is_checked_on_that_path_without_a_replay() -> None:
    model = _net("float32")
    window = AppliedWindow(model)
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(32, 16, generator=generator), torch.randint(0, 4, (32,), generator=generator))
    with bf16():
        window.record(batch)
        loss = _loss(model, batch)
    loss.backward()
    report = window.check(_loss)
    assert (report.verdict, report.fault) == ("ok", None), str(report)
    (said,) = report.noted(NoteCode.APPLIED_PATH_INFERRED)
    assert "recorded inside cpu autocast to bfloat16" in said
    window.clear()
    assert window.autocast is None
