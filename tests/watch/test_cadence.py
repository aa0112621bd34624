"""The cadence of a kind of check, without a Trainer: cadence, first check, and the budget's postponements (one
decision each)."""

from __future__ import annotations

from gradwatch.watch.cadence import RECOMPUTED_KEYS, Cadence
from gradwatch.watch.overhead import OverheadClock


def _cadence(every: int, first: int | None, budget: float | None) -> Cadence:
    return Cadence("recomputed", every, first, budget, OverheadClock(), keys=RECOMPUTED_KEYS)


def _run(cadence: Cadence, steps: int, step_seconds: float, check_seconds: float) -> tuple[list[int], list[int]]:
    """Train ``steps`` optimizer steps; returns the steps checked and the steps a budget decision was asked at."""
    now, checked, asked = 0.0, [], []

    def decide(wait: int) -> int:
        asked.append(step)
        return wait

    cadence.clock.restart()
    cadence.start(0)
    for step in range(1, steps + 1):
        now += step_seconds
        cadence.clock.batch_ended(now)
        if cadence.reached(step) and cadence.runs_now(step, decide):
            checked.append(step)
            cadence.clock.check_ran(now, now + check_seconds)
            cadence.ran(check_seconds)
            now += check_seconds
    return checked, asked


def test_checks_follow_the_cadence_and_the_first_check_step() -> None:
    checked, asked = _run(_cadence(4, 1, None), 12, 1.0, 10.0)
    assert checked == [1, 4, 8, 12]
    assert asked == []  # no budget, no decision


def test_the_budget_postpones_expensive_checks_with_one_decision_each() -> None:
    cadence = _cadence(1, 1, 0.01)
    checked, asked = _run(cadence, 3000, 1.0, 8.0)  # a check costs 8 training steps
    # the first check is always made; the next when two checks' cost is 1% of the training time (1600 steps after
    # the first step was timed), the third at three checks' (2400)
    assert checked == [1, 1601, 2401]
    assert cadence.clock.fraction <= 0.01
    assert len(asked) == len(checked) + cadence.postponed == 6  # no decision on the steps in between


def test_cheap_checks_are_never_postponed() -> None:
    cadence = _cadence(100, 1, 0.01)
    checked, _ = _run(cadence, 1000, 1.0, 0.001)
    assert checked == [1, *range(100, 1001, 100)]
    assert cadence.postponed == 0


def test_a_check_runs_while_its_cost_fits_the_budget() -> None:
    cadence = _cadence(1, None, 0.01)
    clock = cadence.clock
    clock.batch_ended(0.0)
    clock.batch_ended(100.0)
    cadence.steps = 100
    clock.check_ran(100.0, 100.4)
    cadence.ran(0.4)
    assert cadence.runs_now(1, lambda wait: wait)  # 0.4 + 0.4 <= 1.0
    clock.check_ran(100.4, 100.8)
    cadence.ran(0.4)
    assert not cadence.runs_now(2, lambda wait: wait)  # 0.8 + 0.4 > 1.0: 20 s more of training, 20 steps
    assert cadence.resume_at == 2 + 20
    assert cadence.pending


def test_micro_batches_of_one_optimizer_step_are_seen_once() -> None:
    cadence = _cadence(2, None, None)
    cadence.start(0)
    assert [cadence.reached(step) for step in [1, 1, 2, 2, 2]] == [False, False, True, False, False]


def test_state_round_trips_across_a_resume() -> None:
    cadence = _cadence(1, 1, 0.01)
    _run(cadence, 500, 1.0, 8.0)
    restored = _cadence(1, 1, 0.01)
    restored.load_state_dict(cadence.state_dict())
    assert restored.state_dict() == cadence.state_dict()
    assert restored.resume_at == cadence.resume_at


def test_a_postponed_check_is_not_reached_before_its_postponement_ends() -> None:
    cadence = _cadence(1, None, 0.01)
    clock = cadence.clock
    clock.batch_ended(0.0)
    clock.batch_ended(100.0)
    cadence.steps = 100
    clock.check_ran(100.0, 100.8)
    cadence.ran(0.8)
    assert not cadence.runs_now(2, lambda wait: wait)  # 1.6 s of checks is 1% of 160 s: 60 steps more
    assert cadence.resume_at == 62
    cadence.start(2)
    # the steps in between are no due steps to act on (a watch asks neither the budget nor the grad scaler there)
    assert [cadence.reached(step) for step in range(3, 63)] == [False] * 59 + [True]
    assert cadence.pending
    assert cadence.last_step == 61
    assert cadence.postponed == 1


def _due(every: int, first: int | None, previous: int, step: int) -> bool:
    """The definition of a due step, written out: the first check's step or a multiple of the cadence in between."""
    return (first is not None and previous < first <= step) or step // every > previous // every


def test_the_next_due_step_is_the_first_step_due() -> None:
    for every, first in [(5, 1), (5, 7), (5, 10), (3, None), (4, 4)]:
        cadence = _cadence(every, first, None)
        for previous in range(30):
            first_due = next(step for step in range(previous + 1, 100) if _due(every, first, previous, step))
            assert cadence.next_due(previous) == first_due, (every, first, previous)
            assert [cadence.due(previous, step) for step in range(40)] == [
                _due(every, first, previous, step) for step in range(40)
            ]


def test_the_steps_known_to_be_quiet_do_not_hide_a_due_step_of_a_state_loaded_from_before() -> None:
    cadence = _cadence(10, None, None)
    cadence.start(0)
    assert [step for step in range(1, 25) if cadence.reached(step) and cadence.runs_now(step, lambda w: w)] == [10, 20]
    cadence.load_state_dict({**cadence.state_dict(), "last_step": 5})  # a checkpoint of step 5
    cadence.start(5)
    assert cadence.reached(12)  # step 10 is due again: what was known quiet after step 20 says nothing of it
