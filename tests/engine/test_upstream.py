"""A backward that ignores ``grad_output`` (warp-ctc's binding, :mod:`gradwatch.engine.culprits.upstream`): weighted
0.5 in a mean of losses its gradient is wrong and the check fails naming its module; as the unweighted last operation
of the loss training's gradient is right, and the check warns of the latent bug, naming the module, without failing.
The fixed binding (the chain rule applied) is clean both ways."""

from __future__ import annotations

import pytest
import torch
from public_bug_models import MultitaskModel, multitask_batch, unweighted_loss, weighted_loss

from gradwatch import check_gradients
from gradwatch.engine.culprits.upstream import CustomBackwards
from gradwatch.engine.results.notes import NoteCode


def _model(buggy: bool) -> MultitaskModel:
    torch.manual_seed(0)
    return MultitaskModel(buggy)


def test_weighted_in_a_mean_loss_it_fails_with_its_module_named() -> None:
    report = check_gradients(_model(buggy=True), multitask_batch(), weighted_loss, random_probes=0, param_probes=0)
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == "sequence_loss", report.culprit_message
    assert report.descent_ratio == pytest.approx(2 / 3, rel=1e-3)  # half the binding's term counted twice


def test_unweighted_as_the_last_operation_it_warns_naming_the_module_without_failing() -> None:
    with pytest.warns(UserWarning, match="sequence_loss"):
        report = check_gradients(_model(buggy=True), multitask_batch(), unweighted_loss)
    assert report.verdict == "ok", str(report)  # the gradient training uses is right
    (note,) = report.noted(NoteCode.UPSTREAM_IGNORED)
    assert "`sequence_loss` (`SequenceLoss`)" in note
    assert "50%" in note


@pytest.mark.parametrize("loss_fn", [weighted_loss, unweighted_loss], ids=["weighted", "unweighted"])
def test_the_fixed_binding_is_clean(loss_fn: object) -> None:
    report = check_gradients(_model(buggy=False), multitask_batch(), loss_fn)  # type: ignore[arg-type]
    assert report.verdict == "ok", str(report)
    assert report.noted(NoteCode.UPSTREAM_IGNORED) == []


def test_only_graphs_with_a_backward_someone_wrote_are_looked_at_again() -> None:
    model, batch = _model(buggy=False), multitask_batch()
    custom = CustomBackwards(unweighted_loss)
    custom(model, batch)
    assert custom.found == "ScaledGradientBackward"
    plain = CustomBackwards(lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    plain(model, batch)
    assert plain.found is None
    # a stock model's check costs what it did: one backward
    report = check_gradients(model, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    assert report.n_backward == 1
