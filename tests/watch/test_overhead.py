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


def test_state_round_trips() -> None:
    clock = OverheadClock()
    clock.batch_ended(0.0)
    clock.batch_ended(3.0)
    clock.check_ran(3.0, 3.25)
    restored = OverheadClock()
    restored.load_state_dict(clock.state_dict())
    assert restored.state_dict() == clock.state_dict()
    assert OverheadClock().fraction == 0.0


def test_the_first_checks_are_kept_apart_from_the_steady_share() -> None:
    clock = OverheadClock()
    clock.batch_ended(0.0)
    clock.add_check(2.0)  # the first applied check, inside batch 1
    clock.batch_ended(3.0)  # 1 s of training beside it
    clock.check_ran(3.0, 6.0)  # the first recomputed check: 3 s
    assert clock.first_seconds == pytest.approx(5.0)
    assert clock.fraction == pytest.approx(5.0)  # 500% of the one second trained: the one-time cost
    assert clock.steady_fraction == 0.0  # nothing but the first checks so far
    clock.batch_ended(105.0)  # 99 s more of training
    clock.check_ran(105.0, 105.5)  # a later check: 0.5 s
    clock.add_check(0.5)  # a later applied check
    assert clock.first_seconds == pytest.approx(5.0)
    assert clock.steady_fraction == pytest.approx(1.0 / 100.0)
    restored = OverheadClock()
    restored.load_state_dict(clock.state_dict())
    assert restored.first_seconds == pytest.approx(5.0)
