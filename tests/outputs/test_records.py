"""records_of: one report, the records every backend shows (finite scalars with log10 forms, text, histograms)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from helpers import SeedModel, seed_batch, seed_loss

from gradwatch import check_gradients
from gradwatch.engine.results.rendering import CULPRIT_PREFIX
from gradwatch.engine.results.report import CheckReport, Probe
from gradwatch.outputs import records_of
from gradwatch.outputs.records import (
    FAULT_NAME_TAG,
    FIRST_CHECKS_SECONDS_TAG,
    FIRST_CHECKS_STEPS_TAG,
    LOG10_OF,
    LOG10_SUFFIX,
    OVERHEAD_PERCENT_TAG,
    OVERHEAD_TAG,
    Overhead,
    applied_records_of,
)
from gradwatch.tensorboard.writer import HISTOGRAM_TAG


@pytest.fixture(scope="module")
def healthy() -> CheckReport:
    return check_gradients(SeedModel(), seed_batch(), seed_loss)


@pytest.fixture(scope="module")
def failing() -> CheckReport:
    return check_gradients(SeedModel(weight_scale=1.1), seed_batch(), seed_loss)


@pytest.mark.slow
def test_a_healthy_check_has_scalars_and_a_histogram_but_no_text(healthy: CheckReport) -> None:
    records = records_of(healthy, overhead=0.004)
    assert records.step == healthy.step
    assert records.report is healthy
    assert records.text is None
    assert not records.failed
    assert records.scalars[OVERHEAD_TAG] == 0.004
    for tag, value in healthy.scalars().items():
        assert records.scalars[tag] == value if math.isfinite(value) else tag not in records.scalars
    assert len(records.histograms[HISTOGRAM_TAG]) == len(healthy.conclusive_rel_errors)


@pytest.mark.slow
def test_relative_errors_are_also_scalars_on_a_log10_scale(healthy: CheckReport, failing: CheckReport) -> None:
    for report in (healthy, failing):
        scalars = records_of(report).scalars
        for tag in LOG10_OF:
            assert scalars[tag + LOG10_SUFFIX] == pytest.approx(math.log10(scalars[tag]))
    assert records_of(healthy).scalars["gradwatch/rel_error_max_log10"] < -4  # far below a failing check's
    assert records_of(failing).scalars["gradwatch/rel_error_max_log10"] > -2


def test_a_failing_check_has_the_markdown_text(failing: CheckReport) -> None:
    records = records_of(failing)
    assert records.failed
    assert records.text is not None
    assert records.text.startswith("gradient check **failed** at step 0")
    assert "| tensor | `fc.weight` |" in records.text
    culprit = dataclasses.replace(failing, culprit_message="the backward of `fc` is wrong", culprits=["fc"])
    assert f"{CULPRIT_PREFIX}the backward of `fc` is wrong" in str(records_of(culprit).text)


def test_no_backend_receives_a_non_finite_scalar() -> None:
    probe = Probe("param", "w", (0,), math.nan, math.nan, math.nan, verdict="inconclusive", noise=math.inf, step=1e-3,
                  reason="nonfinite")  # type: ignore[arg-type]  # fmt: skip
    report = CheckReport(step=1, verdict="inconclusive", probes=[probe], loss=math.nan, n_forward=1, n_backward=1,
                         duration_s=0.1)  # fmt: skip
    records = records_of(report, overhead=math.inf)
    assert all(math.isfinite(value) for value in records.scalars.values())
    assert "gradwatch/descent_ratio" not in records.scalars
    assert OVERHEAD_TAG not in records.scalars
    assert records.histograms == {}


def test_the_overhead_is_logged_as_a_percentage_with_the_first_checks_apart(healthy: CheckReport) -> None:
    # 713x at step 1 is the first checks' 2.5 s against 3.5 ms of training: a one-time cost, not a share
    scalars = records_of(healthy, overhead=Overhead(713.0, 0.0, 2.5, math.nan)).scalars
    assert scalars[OVERHEAD_TAG] == 713.0  # the ratio max_overhead bounds, as before
    assert scalars[OVERHEAD_PERCENT_TAG] == 0.0
    assert scalars[FIRST_CHECKS_SECONDS_TAG] == 2.5
    assert FIRST_CHECKS_STEPS_TAG not in scalars  # no training step timed yet
    later = records_of(healthy, overhead=Overhead(0.03, 0.008, 2.5, 0.005)).scalars
    assert later[OVERHEAD_PERCENT_TAG] == pytest.approx(0.8)
    assert later[FIRST_CHECKS_STEPS_TAG] == pytest.approx(500.0)


def test_a_failing_applied_check_names_its_fault_in_words_beside_its_code(healthy: CheckReport) -> None:
    report = dataclasses.replace(healthy, scope="applied", verdict="fail").with_findings(
        fault="precision", fault_message="x"
    )
    records = applied_records_of(report)
    assert records.scalars["gradwatch/applied/fault"] == 2.0  # the numeric code stays: FAULTS' position plus one
    assert records.labels == {FAULT_NAME_TAG: "precision"}
    assert applied_records_of(dataclasses.replace(healthy, scope="applied")).labels == {}
