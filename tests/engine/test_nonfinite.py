"""A gradient that is not finite where the loss's derivative is (kornia #3949: ``sqrt`` under ``torch.where`` at the
identity rotation back-propagates NaN from the branch not taken) fails the check with the module named, the indices
where it happens and the loss's finite central differences there; the fixed formula is clean; a loss that is not
finite at the point says so. :mod:`gradwatch.engine.recomputed.nonfinite`."""

from __future__ import annotations

import math

import torch
from public_bug_models import PosedModel, points_batch, regression_loss

from gradwatch import GradientWatch, check_gradients
from gradwatch.engine.recomputed.nonfinite import nonfinite_entries
from gradwatch.engine.results.notes import NoteCode


def _model(fixed: bool) -> PosedModel:
    torch.manual_seed(0)
    return PosedModel(fixed)


def _true_gradient() -> torch.Tensor:
    """The derivative at the identity, from the fixed formula (the same function)."""
    model = _model(fixed=True)
    regression_loss(model, points_batch()).backward()
    assert model.pose.axis_angle.grad is not None
    return model.pose.axis_angle.grad


def test_nan_from_the_branch_not_taken_fails_with_the_module_the_indices_and_the_finite_differences() -> None:
    report = check_gradients(_model(fixed=False), points_batch(), regression_loss)
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == "pose", report.culprit_message
    assert "`pose.axis_angle` at [0, 0], [0, 1]" in report.culprit_message
    assert "12 of 12 entries" in report.culprit_message
    truth = _true_gradient()
    measured = [p for p in report.probes if p.reason == "nonfinite"]
    assert len(measured) == 2
    for probe in measured:
        assert probe.target == "pose.axis_angle"
        assert math.isnan(probe.analytic)
        assert probe.index is not None
        assert math.isfinite(probe.numeric)
        assert abs(probe.numeric - float(truth[probe.index])) <= 0.02 * float(truth.abs().max())


def test_the_fixed_formula_is_clean() -> None:
    report = check_gradients(_model(fixed=True), points_batch(), regression_loss)
    assert report.verdict == "ok", str(report)


def test_the_applied_check_names_the_tensor_the_indices_and_the_module() -> None:
    model = _model(fixed=False)
    watch = GradientWatch(every_n_steps=100, applied_every_n_steps=1, max_overhead=None, on_fail=lambda r: None)
    batch = points_batch()
    watch.record(batch)
    regression_loss(model, batch).backward()
    watch.before_optimizer_step(model, regression_loss, step=1)  # never raises: a check does not end a run
    (report,) = watch.applied_reports
    assert report.verdict == "fail", str(report)
    assert "`pose.axis_angle` at [0, 0]" in report.fault_message
    assert report.culprits[0] == "pose", report.culprit_message


def test_a_loss_not_finite_at_the_point_says_so() -> None:
    model = _model(fixed=True)
    with torch.no_grad():
        model.head.bias.fill_(math.inf)
    report = check_gradients(model, points_batch(), regression_loss)
    assert report.verdict == "fail", str(report)
    (note,) = report.noted(NoteCode.NONFINITE_LOSS)
    assert "the loss itself is" in note


def test_the_entries_are_listed_by_tensor() -> None:
    grad = torch.zeros(3, 4)
    grad[1, 2] = math.nan
    grad[2, 0] = math.inf
    text = nonfinite_entries([("a", grad), ("b", torch.ones(2)), ("c", None)])
    assert text == "`a` at [1, 2], [2, 0] (2 of 12 entries)"
