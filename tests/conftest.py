"""Suite-wide pytest set-up: the quick command's promise kept visible.

The README's test command runs ``-m "not slow"``, and its time is written there. A test that fits a trainer, starts
processes or a browser carries ``@pytest.mark.slow`` (or ``pytestmark``); one that is not marked and still takes long
is listed at the end of the run, so the quick command stays quick without a timed test. Shared models, batches and
trainers are in ``helpers.py``; the two-process drivers in ``two_processes.py``.

Each test starts with the global module and optimizer hooks the tests before it found: a test that captures a
``TrainingState`` or leaves a watch's last update check pending would otherwise leave a global optimizer step hook
running in every later test, so that one test's outcome could depend on which tests ran before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch.nn.modules.module as _modules
import torch.optim.optimizer as _optimizers

UNMARKED_LIMIT_S = 15.0
"""An unmarked test slower than this (setup, call and teardown together) is listed as one to mark ``slow``: the quick
command's ~1,300 tests must share its 10 minutes on 2 cores."""

_slow_unmarked: dict[str, float] = {}
_marked_slow: set[str] = set()


_GLOBAL_HOOKS = (
    _optimizers._global_optimizer_pre_hooks,
    _optimizers._global_optimizer_post_hooks,
    _modules._global_forward_hooks,
    _modules._global_forward_pre_hooks,
    _modules._global_backward_hooks,
    _modules._global_backward_pre_hooks,
)


@pytest.fixture(autouse=True)
def _global_hooks_put_back() -> Iterator[None]:
    """Remove the global hooks a test installed and left behind (see the module docstring)."""
    before = [set(hooks) for hooks in _GLOBAL_HOOKS]
    yield
    for hooks, kept in zip(_GLOBAL_HOOKS, before, strict=True):
        for key in [key for key in hooks if key not in kept]:
            del hooks[key]


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
