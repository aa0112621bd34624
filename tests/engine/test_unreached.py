"""Trainable parameters the loss never reaches (a Linear whose forward drops its bias, as a wrapper's
``__torch_function__`` did in torchao #4846): a note naming the bias with its module in both kinds of check, no failing
verdict; under a watch, one console warning per run; a parameter whose gradient is missing while the loss depends on
it fails instead, without that note."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradwatch import GradientCheckWarning, GradientWatch, check_applied_gradient, check_gradients
from gradwatch.engine.results.notes import NoteCode


class BiasDropped(nn.Linear):
    """A Linear whose forward calls ``F.linear(x, self.weight)``: its bias requires a gradient and never gets one."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class BiasDetached(nn.Linear):
    """A Linear whose bias reaches the loss detached: no gradient, yet the loss depends on it (a real bug)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias.detach())


class Net(nn.Module):
    def __init__(self, first: type[nn.Linear] = BiasDropped) -> None:
        super().__init__()
        self.encoder = first(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.encoder(x)))


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def _batch(seed: int = 0) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)


def test_a_dropped_bias_is_named_in_both_kinds_of_check_without_a_failure() -> None:
    torch.manual_seed(0)
    model, batch = Net(), _batch()
    recomputed = check_gradients(model, batch, _loss)
    _loss(model, batch).backward()
    assert model.encoder.bias.grad is None
    applied = check_applied_gradient(model, [batch], _loss)
    for report in (recomputed, applied):
        assert report.verdict == "ok", report
        (note,) = report.noted(NoteCode.UNREACHED_PARAMETERS)
        assert "'encoder.bias' (bias of BiasDropped 'encoder')" in note
        assert "head" not in note
    assert "found the loss flat" in recomputed.noted(NoteCode.UNREACHED_PARAMETERS)[0]


def test_a_model_whose_every_parameter_gets_a_gradient_has_no_such_note() -> None:
    torch.manual_seed(0)
    model, batch = Net(nn.Linear), _batch()
    assert not check_gradients(model, batch, _loss).noted(NoteCode.UNREACHED_PARAMETERS)


def test_a_missing_gradient_the_loss_depends_on_fails_instead_of_being_noted() -> None:
    torch.manual_seed(0)
    report = check_gradients(Net(BiasDetached), _batch(), _loss)
    assert report.verdict == "fail"
    assert any(probe.target == "encoder.bias" and probe.verdict == "fail" for probe in report.probes)
    assert not report.noted(NoteCode.UNREACHED_PARAMETERS)


def test_a_watch_warns_of_a_dropped_bias_once_per_run() -> None:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = GradientWatch(every_n_steps=1, max_overhead=None, applied_every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 4):
            batch = _batch(step)
            watch.record(batch)
            _loss(model, batch).backward()
            watch.before_optimizer_step(model, _loss, step=step)
            optimizer.step()
            optimizer.zero_grad()
            watch.maybe_check(model, batch, _loss, step=step)
    checks = [r for r in watch.reports if not any(p.kind == "update" for p in r.probes)]  # not the update checks
    assert [r.scope for r in checks] == ["applied", "recomputed"] * 3
    assert all(report.noted(NoteCode.UNREACHED_PARAMETERS) for report in checks)
    said = [w for w in caught if issubclass(w.category, GradientCheckWarning) and "never reaches" in str(w.message)]
    assert len(said) == 1
    assert "encoder.bias" in str(said[0].message)
