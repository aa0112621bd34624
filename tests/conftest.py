"""Suite-wide pytest set-up: the quick command's promise kept visible.

The README's test command runs ``-m "not slow"``, and its time is written there. A test that fits a trainer, starts
processes or a browser carries ``@pytest.mark.slow`` (or ``pytestmark``); one that is not marked and still takes long
is listed at the end of the run, so the quick command stays quick without a timed test. Shared models, batches and
trainers are in ``helpers.py``; the two-process drivers in ``two_processes.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

UNMARKED_LIMIT_S = 15.0
"""An unmarked test slower than this (setup, call and teardown together) is listed as one to mark ``slow``: the quick
command's ~1,300 tests must share its 10 minutes on 2 cores."""

_slow_unmarked: dict[str, float] = {}
_marked_slow: set[str] = set()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _marked_slow.update(item.nodeid for item in items if item.get_closest_marker("slow") is not None)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.nodeid in _marked_slow:
        return
    _slow_unmarked[report.nodeid] = _slow_unmarked.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    over = sorted(((s, n) for n, s in _slow_unmarked.items() if s > UNMARKED_LIMIT_S), reverse=True)
    if not over:
        return
    terminalreporter.section(f"unmarked tests over {UNMARKED_LIMIT_S:.0f} s (mark them slow)")
    for seconds, nodeid in over:
        terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
