"""The escalation ladder on functions whose derivatives are known exactly: a probe spends what settling it takes."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import pytest
import torch

from gradwatch.engine.numerics.stencil import PAIR_OFFSETS, Point, Stencil
from gradwatch.engine.numerics.steps import CONFIRMATION_STEP, FINER_STEP
from gradwatch.engine.probing.ladder import Ladder
from gradwatch.engine.probing.tasks import ProbeTask

CENTER = 1.0


class Line:
    """A direction along which the loss is ``f(t)``; ``analytic`` plays autograd's derivative."""

    def __init__(self, f: Callable[[float], float], analytic: float) -> None:
        self.f = f
        self.analytic = analytic


class ExactMeasurements:
    """The measuring service for :class:`Line` directions, with exact displacements, counting evaluations."""

    def __init__(self) -> None:
        self.center = CENTER
        self.jitter = 0.0
        self.compute_dtype = torch.float64
        self.value_epsilon = 2.2e-16
        self.evaluator = SimpleNamespace(notes=[])
        self.evaluated = 0
        self.prefetched: list[tuple[Line, float, tuple[float, ...]]] = []

    def prefetch(self, requests: Sequence[tuple[Line, float, Sequence[float]]]) -> None:
        self.prefetched += [(direction, step, tuple(offsets)) for direction, step, offsets in requests]

    def points(self, direction: Line, step: float, offsets: Sequence[float]) -> tuple[Point, ...]:
        self.evaluated += len(offsets)
        return tuple(Point(o, direction.f(o * step), o * step, direction.analytic * o * step) for o in offsets)

    def stencil(self, direction: Line, step: float, offsets: Sequence[float]) -> Stencil:
        return Stencil(step, self.center, direction.analytic, self.points(direction, step, offsets))

    def screen(self, direction: Line, step: float, key: object = None) -> Stencil:
        return self.stencil(direction, step, PAIR_OFFSETS)

    def centred(self, stencil: Stencil) -> Stencil:
        return stencil


def _smooth(slope: float) -> Callable[[float], float]:
    return lambda t: CENTER + slope * t + 0.5 * t**2 - t**3 / 6


def _task(direction: Line, index: tuple[int, ...] | None = None, step: float = 1e-3) -> ProbeTask:
    return ProbeTask("tensor" if index is None else "param", "w", index, direction, step, scale_floor=0.0)  # type: ignore[arg-type]


def _ladder(measurements: ExactMeasurements) -> Ladder:
    return Ladder(
        measurements,  # type: ignore[arg-type]
        rtol=1e-7,
        native_dtype=torch.float64,
        reference_loss=CENTER,
        float64_refinement=False,
    )


def _anchored(measurements: ExactMeasurements) -> tuple[Ladder, ProbeTask]:
    ladder = _ladder(measurements)
    anchor = _task(Line(_smooth(2.0), analytic=2.0))
    ladder.first_round(anchor, [])
    return ladder, anchor


def test_the_anchor_is_a_full_stencil_whose_noise_the_screens_borrow() -> None:
    measurements = ExactMeasurements()
    ladder, anchor = _anchored(measurements)
    assert anchor.evaluations == 4
    assert anchor.result is not None
    assert (anchor.result.verdict, anchor.result.reason) == ("ok", "agrees")
    assert ladder.loss_noise == anchor.result.loss_noise
    assert math.isfinite(ladder.loss_noise)


def test_a_screen_that_agrees_settles_the_probe_with_two_evaluations() -> None:
    measurements = ExactMeasurements()
    ladder, _ = _anchored(measurements)
    task = _task(Line(_smooth(-3.0), analytic=-3.0))
    ladder.screen_and_escalate([task])
    assert task.evaluations == 2
    assert task.result is not None
    assert (task.result.verdict, task.result.reason) == ("ok", "agrees")


def test_a_wrong_derivative_climbs_to_a_confirmed_failure_at_an_independent_step() -> None:
    measurements = ExactMeasurements()
    ladder, _ = _anchored(measurements)
    task = _task(Line(_smooth(-3.0), analytic=-3.0 * 1.01))
    ladder.screen_and_escalate([task])
    assert task.result is not None
    assert (task.result.verdict, task.result.reason) == ("fail", "discrepancy")
    assert task.evaluations == 2 + 2 + 4  # screen, its completion, the confirming stencil
    assert task.step == pytest.approx(1e-3 * CONFIRMATION_STEP)
    assert task.probe().numeric == pytest.approx(-3.0, rel=1e-8)


def _kinked(at: float) -> Callable[[float], float]:
    """Slope 2 and a kink at ``at`` that turns the slope to 3: a ReLU unit changing sides inside the stencil."""
    return lambda t: CENTER + 2.0 * t + max(t - at, 0.0)


def test_a_direction_that_crossed_a_kink_is_measured_again_at_a_finer_step() -> None:
    measurements = ExactMeasurements()
    ladder, _ = _anchored(measurements)
    task = _task(Line(_kinked(0.6e-3), analytic=2.0))
    ladder.screen_and_escalate([task])
    assert task.step == pytest.approx(1e-3 * FINER_STEP)  # the kink is outside the finer stencil
    assert task.result is not None
    assert (task.result.verdict, task.result.reason) == ("ok", "agrees")
    assert task.evaluations == 2 + 2 + 4


def test_a_coordinate_that_crossed_a_kink_stays_undecided_for_the_portfolio_to_replace() -> None:
    measurements = ExactMeasurements()
    ladder, _ = _anchored(measurements)
    task = _task(Line(_kinked(0.6e-3), analytic=2.0), index=(0,))
    ladder.screen_and_escalate([task])
    assert task.step == 1e-3
    assert task.result is not None
    assert (task.result.verdict, task.result.reason) == ("inconclusive", "kink")
    assert task.evaluations == 4


def test_each_rung_asks_for_all_its_points_ahead() -> None:
    measurements = ExactMeasurements()
    ladder = _ladder(measurements)
    anchor = _task(Line(_smooth(2.0), analytic=2.0))
    screens = [_task(Line(_smooth(1.0), analytic=1.0)), _task(Line(_smooth(1.0), analytic=1.1))]
    ladder.first_round(anchor, screens)
    first = measurements.prefetched[:3]
    assert [offsets for _, _, offsets in first] == [(1.0, -1.0, 0.5, -0.5), (1.0, -1.0), (1.0, -1.0)]
    assert (screens[1].direction, 1e-3, (0.5, -0.5)) in measurements.prefetched  # the suspect's completion


def test_no_float64_remeasurement_unless_asked() -> None:
    measurements = ExactMeasurements()
    ladder, _ = _anchored(measurements)
    task = _task(Line(_kinked(0.6e-3), analytic=2.0), index=(0,))
    ladder.screen_and_escalate([task])
    before = measurements.evaluated
    ladder.remeasure_in_float64([task])
    assert measurements.evaluated == before
    assert measurements.evaluator.notes == []
