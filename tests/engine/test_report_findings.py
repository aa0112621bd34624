"""The applied findings nested in a report: ``report.applied`` is ``None`` for a recomputed check and carries the fault
and the calibration of an applied one, and the old attribute names (``report.fault``, ``report.noise_floor``, ...) read
the same values, with today's defaults where there are no findings."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from applied_models import MLP, batch_for, bf16, cross_entropy, train_window
from helpers import SeedModel, seed_batch, seed_loss

from gradwatch import AppliedFindings, CheckReport, check_gradients
from gradwatch.engine.applied.clipping import GradientNorms, check_clip_norm
from gradwatch.engine.results.findings import FINDINGS

OLD_NAMES = ("fault", "fault_message", "noise_floor", "floor_excess", "accumulation_scale", "accumulation_cosine")


def _same(a: object, b: object) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_a_recomputed_report_has_no_findings_and_the_old_names_read_their_defaults() -> None:
    report = check_gradients(SeedModel(), seed_batch(), seed_loss)
    assert report.scope == "recomputed"
    assert report.applied is None
    assert report.fault is None
    assert report.fault_message == ""
    for name in ("noise_floor", "floor_excess", "accumulation_scale", "accumulation_cosine"):
        assert math.isnan(getattr(report, name)), name


def test_an_applied_report_carries_its_findings_and_the_old_names_read_them() -> None:
    torch.manual_seed(0)
    model = MLP(autocast_fault=1.5)
    window = train_window(model, [batch_for(model, seed=1), batch_for(model, seed=2)], bf16)
    report = window.check(cross_entropy, path=bf16)
    assert report.scope == "applied"
    assert isinstance(report.applied, AppliedFindings)
    assert report.applied.fault == "precision"
    assert report.applied.fault_message
    assert report.applied.floor_excess > 1
    assert math.isfinite(report.applied.noise_floor)
    assert math.isfinite(report.applied.accumulation_scale)  # two micro-batches: compared with one batch
    for name in OLD_NAMES:
        assert _same(getattr(report, name), getattr(report.applied, name)), name


def test_a_passing_applied_report_has_findings_without_a_fault() -> None:
    torch.manual_seed(0)
    model = MLP()
    window = train_window(model, [batch_for(model, seed=1)])
    report = window.check(cross_entropy)
    assert report.verdict == "ok"
    assert report.applied is not None
    assert report.applied.fault is None
    assert report.fault is None
    assert report.applied.floor_excess <= 1
    assert math.isfinite(report.noise_floor)


def test_a_clipping_report_nests_its_fault() -> None:
    verified = GradientNorms.of([torch.full((4,), 3.0), torch.full((3,), 4.0)])
    wrong = check_clip_norm(verified, 2 * verified.total, max_norm=1.0, step=3)
    assert wrong.verdict == "fail"
    assert wrong.applied is not None
    assert wrong.applied.fault == "clipping" == wrong.fault
    assert wrong.fault_message == wrong.applied.fault_message != ""
    right = check_clip_norm(verified, verified.total, max_norm=1.0, step=3)
    assert right.verdict == "ok"
    assert right.applied is not None
    assert right.fault is None
    assert right.fault_message == ""


def test_the_old_names_are_read_only_and_with_findings_changes_a_copy() -> None:
    report = check_gradients(SeedModel(), seed_batch(), seed_loss)
    with pytest.raises((AttributeError, TypeError)):
        report.fault = "precision"  # type: ignore[misc]
    with pytest.raises(TypeError):
        dataclasses.replace(report, fault="precision")  # type: ignore[call-arg]
    changed = report.with_findings(fault="modified", fault_message="again")
    assert (changed.fault, changed.fault_message, changed.applied) == (
        "modified", "again", AppliedFindings(fault="modified", fault_message="again"),
    )  # fmt: skip
    assert math.isnan(changed.noise_floor)
    assert report.applied is None  # the original is untouched
    assert tuple(f.name for f in dataclasses.fields(AppliedFindings)) == FINDINGS == OLD_NAMES
    assert not set(FINDINGS) & {f.name for f in dataclasses.fields(CheckReport)}
