"""Writes behind autograd's back (:mod:`gradwatch.engine.culprits.writes`): a module that writes into a softmax's
output through ``.data`` after the softmax saved it (as Liger's cross entropy stores its gradient into its input) makes
the upstream gradient wrong while every formula is right; the check fails and names the module that wrote, not the
first module whose gradient is wrong. The same model without the write is clean, and a BatchNorm that updates the
running statistics its earlier call saved is not taken for a writer."""

from __future__ import annotations

import torch
from public_bug_models import SharedNormNet, SoftmaxClassifier, classification_loss, multitask_batch, scored_loss

from gradwatch import check_gradients


def test_a_data_write_into_a_saved_softmax_output_names_the_module_that_wrote() -> None:
    torch.manual_seed(0)
    report = check_gradients(SoftmaxClassifier(buggy=True), multitask_batch(), scored_loss)
    assert report.verdict == "fail", str(report)
    assert report.culprits == ["score"], report.culprit_message
    expected = "`score` (`InPlaceScore`) writes into a tensor that an operation of `probabilities`"
    assert expected in report.culprit_message


def test_the_same_model_without_the_write_is_clean() -> None:
    torch.manual_seed(0)
    report = check_gradients(SoftmaxClassifier(buggy=False), multitask_batch(), scored_loss)
    assert report.verdict == "ok", str(report)


def test_a_batch_norm_updating_its_own_saved_statistics_is_no_writer() -> None:
    torch.manual_seed(0)
    report = check_gradients(SharedNormNet(), multitask_batch(), classification_loss)
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == "inner", report.culprit_message
