"""The first applied check's closer look, left for a later check when its combined probes agree
(``engine/applied/probes.py``): decided by counted evaluations and verdicts, never by a clock."""

from __future__ import annotations

import math

import pytest
import torch
from applied_models import CNN, batch_for, cross_entropy

from gradwatch import AppliedWindow
from gradwatch.engine.applied.measured import Measured
from gradwatch.engine.applied.probes import deferred, waits
from gradwatch.engine.results.kinds import ProbeKind, Reason, Verdict
from gradwatch.engine.results.notes import NoteCode
from gradwatch.engine.results.report import CheckReport, Probe


def _measured(verdict: str, excess: float, tolerance: float) -> Measured:
    """A balanced probe over two tensors of gradient norm 1 (weights ``1/√2``) with this verdict and excess."""
    probe = Probe(ProbeKind.TENSORS, "*", None, 1.0, 1.0, 0.0, verdict=Verdict(verdict), noise=0.0, step=1e-3,
                  reason=Reason.AGREES if verdict == "ok" else Reason.DISCREPANCY)  # fmt: skip
    weight = 1 / math.sqrt(2)
    return Measured(probe, (0, 1), (weight, weight), tolerance, excess)


SIZES, FLOORS, MULTIPLE = [1.0, 1.0], [1e-7, 1e-7], 2.0


def test_waits_when_agreeing_probes_would_call_for_a_closer_look() -> None:
    assert waits([_measured("ok", 0.7, 1e-6)], SIZES, FLOORS, MULTIPLE)  # above CLOSER_LOOK: tensor probes would follow
    assert waits([_measured("ok", 0.1, 1e-2)], SIZES, FLOORS, MULTIPLE)  # calm, but too coarse to vouch for a tensor


def test_does_not_wait_when_a_probe_disagrees_or_nothing_is_left_to_look_at() -> None:
    assert not waits([_measured("fail", 3.0, 1e-6)], SIZES, FLOORS, MULTIPLE)
    assert not waits([_measured("ok", 0.1, 1e-6), _measured("fail", 1.5, 1e-6)], SIZES, FLOORS, MULTIPLE)
    assert not waits([_measured("inconclusive", math.nan, 1e-6)], SIZES, FLOORS, MULTIPLE)
    assert not waits([_measured("ok", 0.1, 1e-6)], SIZES, FLOORS, MULTIPLE)  # calm, every tensor vouched for
    assert not waits([], SIZES, FLOORS, MULTIPLE)


def _check(closer_look: bool, fault: tuple[str, float] | None = None) -> CheckReport:
    """The applied check of the CNN's first window at initialisation (a convolution before BatchNorm, whose float32
    rounding keeps its first check from being calm), with ``fault`` (a tensor's gradient scaled) planted."""
    torch.manual_seed(0)
    model = CNN()
    batch = batch_for(model, size=64, seed=1)
    window = AppliedWindow(model)
    window.record(batch)
    hook = None
    if fault is not None:
        name, factor = fault
        hook = dict(model.named_parameters())[name].register_hook(lambda g: g * factor)
    cross_entropy(model, batch).backward()
    if hook is not None:
        hook.remove()
    return window.check(cross_entropy, closer_look=closer_look)


def test_a_healthy_first_check_stops_after_its_combined_probes_and_says_so() -> None:
    full, first = _check(closer_look=True), _check(closer_look=False)
    assert full.verdict == first.verdict == "ok"
    assert not deferred(full.notes)
    assert deferred(first.notes)
    note = next(n for n in first.notes if n.code == NoteCode.APPLIED_CLOSER_LOOK_DEFERRED)
    assert "no tensor was probed one by one" in note
    assert {p.kind for p in first.probes} == {"descent", "tensors"}
    assert first.n_forward < full.n_forward  # the closer look's evaluations are not made
    assert first.n_backward < full.n_backward  # nor the float64 floor's backward


@pytest.mark.parametrize(("name", "factor"), [("conv1.weight", 1.003), ("bn2.bias", 1.05), ("fc.weight", 1.003)])
def test_a_real_fault_at_the_first_check_is_caught_there_as_before(name: str, factor: float) -> None:
    full, first = _check(closer_look=True, fault=(name, factor)), _check(closer_look=False, fault=(name, factor))
    assert first.verdict == "fail"
    assert not deferred(first.notes)
    assert name in first.failed_tensors
    assert (first.fault, first.failed_tensors, first.n_forward) == (full.fault, full.failed_tensors, full.n_forward)
