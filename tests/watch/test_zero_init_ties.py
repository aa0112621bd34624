"""A ResNet whose blocks end in a zero-initialised BatchNorm (timm's ResNet-18 at initialisation): at step 1 the
residual branches add exactly 0 and the blocks' last ReLUs see exact zeros, ties along the last BatchNorms' directions.
Neither kind of check fails it there (the applied check's stencils show the kink,
:mod:`gradwatch.engine.numerics.kinks`, as the recomputed check's shifted point does), while a 3% bug in the stem
convolution's weight gradient is caught."""

from __future__ import annotations

import torch
from public_bug_models import ZeroInitResNet, classification_loss, image_batches

from gradwatch import GradientWatch, check_gradients
from gradwatch.engine.results.report import CheckReport

TIED = ["blocks.0.bn2.bias", "blocks.1.bn2.bias", "blocks.0.bn2.weight", "blocks.1.bn2.weight"]


def _first_step(bug: float | None) -> tuple[CheckReport, CheckReport]:
    """One plain-loop step under ``GradientWatch`` with both kinds of check due: (applied, recomputed)."""
    torch.manual_seed(0)
    model = ZeroInitResNet(bug)
    watch = GradientWatch(every_n_steps=1, applied_every_n_steps=1, max_overhead=None, on_fail=lambda report: None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = image_batches(1)[0]
    watch.record(batch)
    classification_loss(model, batch).backward()
    watch.before_optimizer_step(model, classification_loss, step=1)
    optimizer.step()
    optimizer.zero_grad()
    watch.maybe_check(model, batch, classification_loss, step=1)
    return watch.applied_reports[0], next(r for r in watch.reports if r.scope == "recomputed")


def test_exact_relu_ties_at_initialisation_fail_no_check_of_either_kind() -> None:
    applied, recomputed = _first_step(bug=None)
    assert applied.verdict != "fail", str(applied)
    assert recomputed.verdict != "fail", str(recomputed)
    # the ties are there, and the applied check saw them as such (not as a formula it could not tell)
    assert any(p.reason == "tie" for p in applied.probes), str(applied)


def test_the_tied_tensors_probed_by_the_recomputed_check_are_not_failed() -> None:
    torch.manual_seed(0)
    model = ZeroInitResNet()
    report = check_gradients(model, image_batches(1)[0], classification_loss, focus=TIED)
    assert {p.target for p in report.probes} >= set(TIED), str(report)
    assert report.verdict != "fail", str(report)


def test_a_three_percent_bug_in_a_convolution_is_still_caught_at_the_ties() -> None:
    applied, recomputed = _first_step(bug=1.03)
    assert (applied.verdict, applied.fault) == ("fail", "formula"), str(applied)
    assert "stem.weight" in {p.target for p in applied.failures}, str(applied)
    assert recomputed.verdict == "fail", str(recomputed)
