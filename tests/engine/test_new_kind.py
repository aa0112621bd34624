"""Adding a probe kind is one row of the kinds table and one portfolio method, for both checks
(engine/results/kinds.py, engine/probing/portfolio.py): a fixture adds a kind, along the gradient of the first half of
the tensors, and both the recomputed and the applied check make it, measure it up the ladder and judge it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gradwatch import check_applied_gradient, check_gradients
from gradwatch.engine.measuring.directions import VectorDirection
from gradwatch.engine.probing.portfolio import Portfolio
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.results.kinds import PROBE_KINDS, KindTraits, ProbeKind


@pytest.fixture
def halves(monkeypatch: pytest.MonkeyPatch) -> ProbeKind:
    """A new kind ``"halves"``: its member, its row, and the portfolio method its row names."""
    member = str.__new__(ProbeKind, "halves")
    member._name_, member._value_ = "HALVES", "halves"
    monkeypatch.setitem(ProbeKind._member_map_, "HALVES", member)
    monkeypatch.setitem(ProbeKind._value2member_map_, "halves", member)
    row = KindTraits("along the gradient of the first half of the parameter tensors", moves_parameters=True,
                     vouches=True, starts_culprit_search=True, made_by="halves")  # fmt: skip
    monkeypatch.setitem(PROBE_KINDS, member, row)

    def make(portfolio: Portfolio) -> ProbeTask | None:
        tensors = [i for i, size in enumerate(portfolio.tensor_grad_norms) if size > 0]
        tensors = tensors[: max(1, len(tensors) // 2)]
        if not tensors:
            return None
        size = math.hypot(*(portfolio.tensor_grad_norms[i] for i in tensors))
        grads = [portfolio.grads[i] for i in tensors]
        direction = VectorDirection([portfolio.params[i][1] for i in tensors], grads, grads, 1.0 / size,
                                    components_norm=size)  # fmt: skip
        dtype = portfolio.params[tensors[0]][1].dtype
        step = portfolio._relative_step(dtype) * portfolio._tensor_scale(tensors[0])
        return ProbeTask(member, "first half", None, direction, step, portfolio.loss_floor, moves=tuple(tensors))

    monkeypatch.setattr(Portfolio, "halves", make, raising=False)
    return member


def _model() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, (torch.randn(16, 6), torch.randint(0, 3, (16,)))


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _halves(report: object, kind: ProbeKind) -> list:
    return [p for p in report.probes if p.kind == kind]  # type: ignore[attr-defined]


def test_a_recomputed_check_makes_the_new_kind_and_judges_it(halves: ProbeKind) -> None:
    model, batch = _model()
    healthy = check_gradients(model, batch, _loss)
    (probe,) = _halves(healthy, halves)
    assert (healthy.verdict, probe.verdict, probe.target) == ("ok", "ok", "first half")
    assert probe.evaluations >= 2


@pytest.mark.slow  # the failing check's culprit search
def test_a_recomputed_check_fails_on_the_new_kind_where_its_tensors_gradient_is_wrong(halves: ProbeKind) -> None:
    model, batch = _model()
    model[0].weight.register_hook(lambda grad: grad * 1.1)  # in the first half of the tensors
    broken = check_gradients(model, batch, _loss)
    (probe,) = _halves(broken, halves)
    assert (broken.verdict, probe.verdict, probe.reason) == ("fail", "fail", "discrepancy")


def test_an_applied_check_makes_the_new_kind_and_judges_it_against_the_floor(halves: ProbeKind) -> None:
    model, batch = _model()
    model.zero_grad()
    _loss(model, batch).backward()
    healthy = check_applied_gradient(model, [batch], _loss, culprit_search=False)
    (probe,) = _halves(healthy, halves)
    assert (healthy.verdict, probe.verdict, probe.target) == ("ok", "ok", "first half")
    assert probe.floor is not None
    assert probe.floor > 0
    with torch.no_grad():
        model[0].weight.grad.mul_(1.1)  # the applied gradient of a tensor in the first half, off by 10%
    broken = check_applied_gradient(model, [batch], _loss, culprit_search=False)
    (probe,) = _halves(broken, halves)
    assert (broken.verdict, probe.verdict, probe.reason) == ("fail", "fail", "discrepancy")


def test_without_the_row_no_check_makes_it() -> None:
    model, batch = _model()
    assert not any(row.made_by for row in PROBE_KINDS.values())
    assert {p.kind for p in check_gradients(model, batch, _loss).probes} <= set(PROBE_KINDS)
