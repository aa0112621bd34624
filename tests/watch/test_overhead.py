"""The overhead clock, without a Trainer: training time between batches, check time apart, and the budget."""

from __future__ import annotations

import pytest

from gradwatch.watch.overhead import OverheadClock


def test_training_time_is_measured_between_batches_and_checks_are_apart() -> None:
    clock = OverheadClock()
    clock.batch_ended(10.0)  # the first batch: no training time measured before it
    clock.batch_ended(11.0)
    clock.check_ran(11.0, 11.5)
    clock.batch_ended(12.5)  # one second of training after the check
    assert clock.train_seconds == pytest.approx(2.0)
    assert clock.check_seconds == pytest.approx(0.5)
    assert clock.fraction == pytest.approx(0.25)
    clock.restart()
    clock.batch_ended(100.0)
    assert clock.train_seconds == pytest.approx(2.0)


def test_a_check_is_affordable_while_its_cost_fits_the_budget() -> None:
    clock = OverheadClock()
    clock.batch_ended(0.0)
    clock.batch_ended(100.0)
    clock.check_ran(100.0, 100.4)
    assert clock.affordable(0.01)  # 0.4 + 0.4 <= 1.0
    clock.check_ran(100.4, 100.8)
    assert not clock.affordable(0.01)  # 0.8 + 0.4 > 1.0


def test_state_round_trips() -> None:
    clock = OverheadClock()
    clock.batch_ended(0.0)
    clock.batch_ended(3.0)
    clock.check_ran(3.0, 3.25)
    restored = OverheadClock()
    restored.load_state_dict(clock.state_dict())
    assert restored.state_dict() == clock.state_dict()
    assert OverheadClock().fraction == 0.0
