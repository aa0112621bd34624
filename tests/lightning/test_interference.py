"""Zero interference on the Lightning code users write: each pattern is fitted with and without GradWatch (same seed,
vectorised passes on, the default) and everything the user can observe must be identical, bit for bit: parameters,
optimizer state, every logged value, ``callback_metrics``, the progress bar, the module's own lists, counters, caches
and metric states, and the number of graphs ``torch.compile`` compiled."""

from __future__ import annotations

import importlib.util

import pytest
from lightning_patterns import PATTERNS, Pattern, RaisesDuringChecks, compare, fit

from gradwatch import GradientCheckWarning

pytestmark = pytest.mark.slow


def _inductor_works() -> bool:
    import torch

    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(3))
    except Exception:
        return False
    return True


@pytest.mark.parametrize("pattern", PATTERNS, ids=[p.name for p in PATTERNS])
def test_a_run_with_checks_is_the_run_without(pattern: Pattern) -> None:
    if pattern.needs is not None and importlib.util.find_spec(pattern.needs) is None:
        pytest.skip(f"needs {pattern.needs}")
    if pattern.compiled and not _inductor_works():
        pytest.skip("torch.compile (inductor) cannot compile on this machine")
    without = fit(pattern, with_watch=False)
    with_checks = fit(pattern, with_watch=True)
    assert with_checks.reports, "no check ran"
    reports = with_checks.reports
    assert not any(r.verdict == "fail" for r in reports), "\n\n".join(map(str, reports))
    assert compare(without, with_checks) == []


def test_a_check_that_raises_inside_training_step_changes_nothing_and_training_goes_on() -> None:
    pattern = Pattern("raises during checks", RaisesDuringChecks)
    without = fit(pattern, with_watch=False)
    with pytest.warns(GradientCheckWarning, match="could not run and was skipped"):
        with_checks = fit(pattern, with_watch=True)
    assert with_checks.reports == []  # every check was skipped
    assert compare(without, with_checks) == []
