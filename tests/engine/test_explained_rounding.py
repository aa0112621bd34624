"""The closer look of an applied check once its float64 floor is measured (engine/applied/measured.py): a discrepancy
that the measured rounding of the eager gradient explains along a probe's direction calls for no tensor probes, while
one a fault adds on top does; the verdict itself is left to the tolerance. The
probes then vouch at the storage rounding while what the rounding leaves is calm there, and a fault that the float64
gradient shares (a hook) is still caught in a precise tensor next to tensors with large floors."""

from __future__ import annotations

import math

import torch
from applied_models import ConvBatchNorm
from torch import nn
from torch.nn import functional as F

from gradwatch.engine.applied import AppliedWindow
from gradwatch.engine.applied.measured import Measured, Rounding, calm, explained, vouchers
from gradwatch.engine.applied.measurement import float64_rounding
from gradwatch.engine.applied.path import CheckedWindow
from gradwatch.engine.function.state import TrainingState
from gradwatch.engine.results.kinds import ProbeKind, Reason
from gradwatch.engine.results.report import Probe
from gradwatch.engine.session import CheckSession


def _measured(analytic: float, numeric: float, tolerance: float, predicted: float) -> Measured:
    size = abs(analytic - numeric)
    verdict = "ok" if size <= tolerance else "fail"
    reason = Reason.AGREES if verdict == "ok" else Reason.DISCREPANCY
    probe = Probe(ProbeKind.TENSORS, "*", None, analytic, numeric, size / abs(analytic), verdict=verdict, noise=0.0,
                  step=1e-6, reason=reason, evaluations=2, floor=tolerance / 2)  # fmt: skip
    return Measured(probe, (0, 1), (0.5, 0.5), tolerance, size / tolerance, predicted)


def test_a_discrepancy_the_measured_rounding_explains_is_calm_and_a_fault_on_top_of_it_is_not() -> None:
    # the rounding alone brings the probe to 0.9 of its tolerance: calm once that rounding is known
    rounded = _measured(1.0, 1.0 - 0.9e-6, 1e-6, 0.9e-6)
    assert rounded.excess > 0.5
    assert rounded.closer < 1e-6
    assert calm([rounded])
    # unknown rounding: the excess itself decides, as before
    assert not calm([_measured(1.0, 1.0 - 0.9e-6, 1e-6, 0.0)])
    # a fault of 0.6 of the tolerance on top of a rounding of 0.3: the excess is 0.9, what is left beyond the
    # rounding is 0.6: a closer look
    faulty = _measured(1.0, 1.0 - 0.9e-6, 1e-6, 0.3e-6)
    assert math.isclose(faulty.closer, 0.6)
    assert not calm([faulty])
    # the finite difference's own error cancelling part of the rounding: calm by the excess itself, as before
    cancelled = _measured(1.0, 1.0 - 0.3e-6, 1e-6, 0.9e-6)
    assert math.isclose(cancelled.closer, 0.3)
    assert calm([cancelled])
    # the verdict is the tolerance's: a probe beyond it fails even if the rounding "explains" it
    beyond = _measured(1.0, 1.0 - 1.5e-6, 1e-6, 1.5e-6)
    assert beyond.probe.verdict == "fail"
    assert not calm([beyond])
    assert beyond.combined().excess < 1e-6
    assert beyond.combined().verdict == "fail"


def test_explained_is_the_rounding_along_the_direction() -> None:
    assert explained(None, (0, 1), (1.0, 1.0)) == 0.0
    assert math.isclose(explained([2.0, -3.0, 5.0], (0, 2), (0.5, 0.25)), 0.5 * 2.0 + 0.25 * 5.0)


def test_float64_rounding_gives_each_tensors_distance_from_float64_along_the_applied_gradient() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    batch = torch.randn(16, 6)

    def loss_fn(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return (module(batch) ** 2).sum()

    params = list(model.parameters())
    eager = list(torch.autograd.grad(loss_fn(model, batch), params))
    exact = list(torch.autograd.grad(loss_fn(model.double(), batch.double()), list(model.parameters())))
    model.float()
    applied = [g * 1.5 for g in eager]
    with CheckSession.open(model, loss_fn, step=0, settings=None, options={}, optimizers=()) as session:
        session.select()
        session.state = TrainingState.capture(model)
        setting = CheckedWindow(
            session=session, batches=[batch], loss_fn=loss_fn, rng_states=[None], combine="sum", path=None
        )
        notes: list = []
        distances, rounding = float64_rounding(setting, eager, applied, notes)
        assert rounding is not None
        assert not notes
        for i, (e, x, a) in enumerate(zip(eager, exact, applied, strict=True)):
            assert math.isclose(
                rounding.eager[i], float(((e.double() - x) * a.double()).sum()), rel_tol=1e-6, abs_tol=1e-18
            )
            assert math.isclose(rounding.path[i], float(((a.double() - e.double()) * a.double()).sum()), rel_tol=1e-6)
            assert math.isclose(distances[0][i], float((e.double() - x).norm()), rel_tol=1e-6, abs_tol=1e-18)
        assert all(p > 0.0 for p in rounding.path)  # the applied gradient is 1.5x the eager one
        # 0.5 of each tensor's gradient along itself: far beyond its floor, so probed one by one and left in the closer
        # look of the combined probes (a fault of the training's path)
        norms = [float(a.norm()) for a in applied]
        assert rounding.beyond(norms, distances[0], 2.0) == list(range(len(applied)))
        assert rounding.explained(rounding.beyond(norms, distances[0], 2.0)) == list(rounding.eager)


def test_the_applied_gradients_distance_from_the_eager_one_is_discounted_only_within_half_a_probes_tolerance() -> None:
    rounding = Rounding(eager=[1e-9, 2e-9], path=[3e-9, 4e-7])
    # tensor 0: (1e-9 + 3e-9) / 1 within 0.5 * 2 * 1e-8; tensor 1: 4.02e-7 beyond 1e-8
    assert rounding.beyond([1.0, 1.0], [1e-8, 1e-8], 2.0) == [1]
    assert rounding.explained([1]) == [1e-9 + 3e-9, 2e-9]


def _exact(analytic: float, numeric: float, tolerance: float, predicted: float, exact_tolerance: float) -> Measured:
    measured = _measured(analytic, numeric, tolerance, predicted)
    return Measured(measured.probe, measured.tensors, measured.weights, tolerance, measured.excess, predicted,
                    exact_tolerance=exact_tolerance)  # fmt: skip


def test_probes_vouch_at_the_storage_rounding_only_while_what_the_rounding_leaves_is_calm_there() -> None:
    # the rounding explains the discrepancy to within 0.2 of the tolerance at the storage rounding: vouched there
    calm_one = _exact(1.0, 1.0 - 0.4e-6, 1e-6, 0.4e-6 - 0.02e-6, 0.1e-6)
    chosen = vouchers([calm_one])
    assert chosen[0].tolerance == 0.1e-6
    assert math.isclose(chosen[0].excess, 0.2)
    # what it leaves is 0.6 of that tolerance (a fault a tensor's own probe might see): back to the probe's own
    loud = _exact(1.0, 1.0 - 0.4e-6, 1e-6, 0.4e-6 - 0.06e-6, 0.1e-6)
    for measured in ([loud], [calm_one, loud]):
        assert [c.tolerance for c in vouchers(measured)] == [1e-6] * len(measured)
    # no measured rounding: the probe's own tolerance
    assert vouchers([_measured(1.0, 1.0 - 0.4e-6, 1e-6, 0.0)])[0].tolerance == 1e-6


def test_a_fault_the_float64_gradient_shares_is_caught_in_a_precise_tensor_next_to_large_floors() -> None:
    # the hook stays on during the check: the eager and float64 gradients both hold the 2% fault, so the measured
    # rounding (their difference) does not, and what the probes see beyond the rounding is the fault itself
    for name in ("fc1.weight", "conv2.bias"):
        torch.manual_seed(0)
        model = ConvBatchNorm()
        batch = (torch.randn(32, 3, 12, 12), torch.randint(0, 10, (32,)))
        handle = dict(model.named_parameters())[name].register_hook(lambda grad: grad * 1.02)
        window = AppliedWindow(model)
        window.record(batch)
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        report = window.check(lambda m, b: F.cross_entropy(m(b[0]), b[1]), culprit_search=False)
        handle.remove()
        assert report.verdict == "fail"
        assert name in [p.target for p in report.probes if p.verdict == "fail"]
