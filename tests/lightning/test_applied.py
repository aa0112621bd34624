"""GradWatch's applied checks in real Lightning fits: the gradient at on_before_optimizer_step checked on the
training's path (bf16-mixed autocast, accumulation, manual optimization), faults named, healthy runs clean, and the run
bit-identical with and without them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from applied_models import CNN, MLP, Transformer, batch_for, cross_entropy
from helpers import trainer

from gradwatch import GradientCheckWarning, GradWatch
from gradwatch.watch.defaults import DEFAULT_APPLIED_EVERY_N_STEPS


class _Lit(pl.LightningModule):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = cross_entropy(self.net, batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _ManualForgetsZeroGrad(_Lit):
    """Manual optimization that never zeroes its gradients: every step applies all the gradients so far."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__(net)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = cross_entropy(self.net, batch)
        self.manual_backward(loss)
        self.optimizers().step()  # type: ignore[union-attr]
        return loss


def _loader(net: torch.nn.Module, batches: int = 8) -> torch.utils.data.DataLoader:
    data = [batch_for(net, seed=seed) for seed in range(batches)]
    dataset = torch.utils.data.TensorDataset(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]))
    return torch.utils.data.DataLoader(dataset, batch_size=16)


def _fit(net: torch.nn.Module, callbacks: list[pl.Callback], tmp_path: Path, module: type[_Lit] = _Lit, **options: Any):
    torch.manual_seed(0)
    lit = module(net)
    trainer(tmp_path, callbacks, max_steps=options.pop("max_steps", 3), **options).fit(lit, _loader(net))
    return lit


def test_the_default_cadence_is_documented() -> None:
    assert GradWatch().applied_every_n_steps == DEFAULT_APPLIED_EVERY_N_STEPS
    assert GradWatch(applied_every_n_steps=None).applied_every_n_steps is None
    with pytest.raises(ValueError, match="`applied_every_n_steps` must be None or an integer >= 1; got 0"):
        GradWatch(applied_every_n_steps=0)


@pytest.mark.slow
def test_a_backward_wrong_only_under_bf16_autocast_is_caught_at_the_first_applied_check(tmp_path: Path) -> None:
    torch.manual_seed(0)
    watch = GradWatch(applied_every_n_steps=2, every_n_steps=100, max_overhead=None)
    with pytest.warns(GradientCheckWarning, match="precision fault: applied gradient check failed at step 1"):
        _fit(MLP(autocast_fault=1.5), [watch], tmp_path, precision="bf16-mixed", accumulate_grad_batches=2)
    first = watch.applied_reports[0]
    assert (first.step, first.scope, first.verdict, first.fault) == (1, "applied", "fail", "precision")
    recomputed = [r for r in watch.reports if r.scope == "recomputed"]
    assert recomputed[0].verdict == "ok"  # the recomputed check (eager float32) is right
    assert watch.reports[0] is first  # reports holds both kinds: the applied check ran before the step


@pytest.mark.slow
def test_manual_optimization_that_never_zeroes_gradients_is_an_accumulation_fault(tmp_path: Path) -> None:
    torch.manual_seed(0)
    watch = GradWatch(applied_every_n_steps=1, every_n_steps=100, max_overhead=None, loss_fn=cross_entropy_of_net)
    with pytest.warns(GradientCheckWarning, match="accumulation fault"):
        _fit(MLP(), [watch], tmp_path, module=_ManualForgetsZeroGrad, max_steps=3)
    verdicts = [(r.step, r.verdict, r.fault) for r in watch.applied_reports]
    assert verdicts[0] == (1, "ok", None)  # nothing left over before the first step
    assert verdicts[1] == (2, "fail", "accumulation")  # the first applied check after the fault
    assert all(r.verdict == "ok" for r in watch.recomputed_reports)


def cross_entropy_of_net(module: torch.nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return cross_entropy(module.net, batch)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "accumulate"), [("32-true", 1), ("bf16-mixed", 1), ("32-true", 2)], ids=["32", "bf16", "accumulate"]
)
@pytest.mark.parametrize("net_class", [MLP, CNN, Transformer], ids=["mlp", "cnn", "transformer"])
def test_healthy_runs_pass_and_train_bit_identically(
    tmp_path: Path, net_class: type[torch.nn.Module], precision: str, accumulate: int
) -> None:
    torch.manual_seed(0)
    net = net_class()
    watch = GradWatch(applied_every_n_steps=1, every_n_steps=100, max_overhead=None, first_check_step=None)
    checked = _fit(net, [watch], tmp_path, precision=precision, accumulate_grad_batches=accumulate)
    torch.manual_seed(0)
    plain = _fit(net_class(), [], tmp_path, precision=precision, accumulate_grad_batches=accumulate)
    reports = watch.applied_reports
    assert [r.step for r in reports] == [1, 2, 3]
    assert all(r.verdict == "ok" for r in reports), "\n".join(str(r) for r in reports)
    for (name, a), (_, b) in zip(checked.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_the_gradient_is_checked_before_clipping(tmp_path: Path) -> None:
    """Accumulation with clipping: the applied check sees the accumulated gradient before clipping rescales it (a
    clipped gradient is not the derivative of the loss), and the run trains exactly as without it."""
    torch.manual_seed(0)
    watch = GradWatch(applied_every_n_steps=1, every_n_steps=100, max_overhead=None, first_check_step=None)
    options = {"accumulate_grad_batches": 2, "gradient_clip_val": 1e-3}
    checked = _fit(MLP(), [watch], tmp_path, **options)
    torch.manual_seed(0)
    plain = _fit(MLP(), [], tmp_path, **options)
    probed = [r for r in watch.applied_reports if r.probes]
    assert [(r.step, r.verdict) for r in probed] == [(1, "ok"), (2, "ok"), (3, "ok")]
    assert all(r.descent is not None and r.descent.analytic > 1e-3 for r in probed)  # the unclipped norm
    clipping = [r for r in watch.applied_reports if not r.probes]  # the coefficient Lightning clipped by, checked
    assert [(r.step, r.verdict) for r in clipping] == [(1, "ok"), (2, "ok"), (3, "ok")]
    for (name, a), (_, b) in zip(checked.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


class _ClipsOnAWrongNorm(_Lit):
    """Clips by a norm twice the gradient's (a norm counted twice over a mesh), as a custom clipping hook might."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **_: Any) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm = 2 * torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for g in grads:
            g.mul_(min(1.0, float(gradient_clip_val) / (float(norm) + 1e-6)))


@pytest.mark.slow
def test_a_clip_coefficient_computed_on_a_wrong_norm_fails_as_clipping(tmp_path: Path) -> None:
    watch = GradWatch(applied_every_n_steps=1, every_n_steps=100, max_overhead=None, on_fail=lambda report: None)
    _fit(MLP(), [watch], tmp_path, module=_ClipsOnAWrongNorm, gradient_clip_val=1e-3, max_steps=2)
    faults = [(r.step, r.fault) for r in watch.applied_reports if r.verdict == "fail"]
    assert faults == [(1, "clipping"), (2, "clipping")]
    assert all(r.verdict == "ok" for r in watch.applied_reports if r.probes)  # the gradient before clipping is right


@pytest.mark.slow
def test_under_the_default_budget_the_first_applied_check_runs_at_step_1_and_the_next_waits_for_the_budget(
    tmp_path: Path,
) -> None:
    budgeted = GradWatch(applied_every_n_steps=1)  # the default budget: 1%
    trainer(tmp_path, [budgeted], max_steps=6).fit(_Lit(MLP()), _loader(MLP()))
    assert [r.step for r in budgeted.applied_reports] == [1]  # the first is made (a bug from step 1 is found at once)
    assert [r.step for r in budgeted.recomputed_reports] == [1]  # the recomputed first check too, as always
    state = budgeted.state_dict()
    assert state["applied_pending"]  # the next due one waits until the training time affords it within 1%
    assert state["applied_resume_at"] > 6  # one decision for the postponement, not one per step
    unbudgeted = GradWatch(applied_every_n_steps=1, max_overhead=None)
    trainer(tmp_path, [unbudgeted], max_steps=2).fit(_Lit(MLP()), _loader(MLP()))
    assert [r.step for r in unbudgeted.applied_reports] == [1, 2]


class _UserStepHook(_Lit):
    """Registers its own optimizer step post hook at the first step, after the callback's clipping hook."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__(net)
        self.hook_calls, self.hooked = 0, False

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:  # after the callbacks' hook
        if not self.hooked:
            self.hooked = True
            optimizer.register_step_post_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.hook_calls += 1


@pytest.mark.slow
def test_a_users_step_post_hook_after_the_clipping_check_runs_at_every_step(tmp_path: Path) -> None:
    """The clipping check's own hook is not removed while torch runs the optimizer's hooks (that breaks torch's loop
    over them when a hook follows), yet runs once per step and is gone after the fit."""
    watch = GradWatch(applied_every_n_steps=1, every_n_steps=100, max_overhead=None, first_check_step=None)
    lit = _fit(MLP(), [watch], tmp_path, module=_UserStepHook, gradient_clip_val=1e-3)
    assert lit.hook_calls == 3
    clipping = [r for r in watch.applied_reports if not r.probes]
    assert [(r.step, r.verdict) for r in clipping] == [(1, "ok"), (2, "ok"), (3, "ok")]
    optimizer = lit.trainer.optimizers[0]
    assert list(optimizer._optimizer_step_post_hooks.values()) == [lit._count]  # the callback's hooks removed
