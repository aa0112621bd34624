"""The check schedule, without a Trainer: cadence, first check, and the budget's postponements (one decision each)."""

from __future__ import annotations

from gradwatch.watch.schedule import Schedule


def _run(schedule: Schedule, steps: int, step_seconds: float, check_seconds: float) -> tuple[list[int], list[int]]:
    """Train ``steps`` optimizer steps; returns the steps checked and the steps a budget decision was asked at."""
    now, checked, asked = 0.0, [], []

    def decide(wait: int) -> int:
        asked.append(step)
        return wait

    schedule.start(0)
    for step in range(1, steps + 1):
        now += step_seconds
        if schedule.step_ended(step, now) and schedule.runs_now(step, decide):
            checked.append(step)
            schedule.ran(now, now + check_seconds)
            now += check_seconds
    return checked, asked


def test_checks_follow_the_cadence_and_the_first_check_step() -> None:
    checked, asked = _run(Schedule(4, 1, None), 12, 1.0, 10.0)
    assert checked == [1, 4, 8, 12]
    assert asked == []  # no budget, no decision


def test_the_budget_postpones_expensive_checks_with_one_decision_each() -> None:
    schedule = Schedule(1, 1, 0.01)
    checked, asked = _run(schedule, 3000, 1.0, 8.0)  # a check costs 8 training steps
    # the first check is always made; the next when two checks' cost is 1% of the training time (1600 steps after
    # the first step was timed), the third at three checks' (2400)
    assert checked == [1, 1601, 2401]
    assert schedule.clock.fraction <= 0.01
    assert len(asked) == len(checked) + schedule.postponed == 6  # no decision on the steps in between


def test_cheap_checks_are_never_postponed() -> None:
    schedule = Schedule(100, 1, 0.01)
    checked, _ = _run(schedule, 1000, 1.0, 0.001)
    assert checked == [1, *range(100, 1001, 100)]
    assert schedule.postponed == 0


def test_micro_batches_of_one_optimizer_step_are_seen_once() -> None:
    schedule = Schedule(2, None, None)
    schedule.start(0)
    assert [schedule.step_ended(step, float(i)) for i, step in enumerate([1, 1, 2, 2, 2])] == [
        False,
        False,
        True,
        False,
        False,
    ]


def test_state_round_trips_across_a_resume() -> None:
    schedule = Schedule(1, 1, 0.01)
    _run(schedule, 500, 1.0, 8.0)
    restored = Schedule(1, 1, 0.01)
    restored.load_state_dict(schedule.state_dict())
    assert restored.state_dict() == schedule.state_dict()
    assert restored.resume_at == schedule.resume_at
