"""Values the loss detaches, held at the reference's (gradwatch/engine/function/held.py): a surrogate objective whose
value is flat (``exp(logp - logp.detach())``, GRPO's) is checked on the function autograd differentiates with
``hold_detached``, in float64 and natively, vectorised or not, by the recomputed and the applied check; bugs inside the
model and accidental detaches inside it still fail; a loss that detaches otherwise than in the reference pass is
inconclusive, never a fail. DoRA-like modules (recognised by name) hold their detached weight norm, scoped to
themselves, also through activation checkpointing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gradwatch import check_applied_gradient, check_gradients
from gradwatch.engine.results.notes import NoteCode

Batch = tuple[Tensor, Tensor, Tensor]


class _ScaleBackward(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by ``factor``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:  # type: ignore[override]
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.factor, None


class Gate(nn.Module):
    """An activation whose backward is ``factor`` off (1: correct)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return _ScaleBackward.apply(torch.tanh(x), self.factor)


class Trunk(nn.Module):
    """A linear layer and tanh; ``detach`` cuts it off (an accidental stop-gradient)."""

    def __init__(self, detach: bool) -> None:
        super().__init__()
        self.first = nn.Linear(6, 16)
        self.detach = detach

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.first(x))
        return h.detach() if self.detach else h


class Policy(nn.Module):
    """A small policy; ``bug`` makes its gate's input gradient that factor off, ``detach`` cuts its trunk off."""

    def __init__(self, bug: float = 1.0, detach: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.second, self.head = Trunk(detach), nn.Linear(16, 16), nn.Linear(16, 5)
        self.gate = Gate(bug)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.gate(self.second(self.trunk(x))))


def _batch() -> Batch:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 6, generator=generator)
    return x, torch.randint(0, 5, (8,), generator=generator), torch.randn(8, generator=generator)


def _log_probs(model: nn.Module, batch: Batch) -> Tensor:
    x, actions, _ = batch
    return torch.log_softmax(model(x), -1).gather(1, actions[:, None]).squeeze(1)


def surrogate(model: nn.Module, batch: Batch) -> Tensor:
    """GRPO's clipped objective with one pass per generation: its value is ``-mean(advantages)`` at every point."""
    logp = _log_probs(model, batch)
    ratio = torch.exp(logp - logp.detach())
    advantages = batch[2]
    return -torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages).mean()


def test_a_surrogate_objective_is_flat_as_written() -> None:
    report = check_gradients(Policy(), _batch(), surrogate, tensor_probes=1, random_probes=0, param_probes=0)
    descent = report.probes[0]
    assert (descent.kind, descent.verdict, descent.reason, descent.numeric) == ("descent", "inconclusive", "flat", 0.0)
    assert report.noted(NoteCode.DETACHED_HELD) == []


@pytest.mark.parametrize(("precision", "vectorize"), [("auto", True), ("native", False)], ids=["float64", "native"])
def test_with_its_detaches_held_it_is_the_function_autograd_differentiates(precision: str, vectorize: bool) -> None:
    model = Policy()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    options: dict[str, Any] = {"precision": precision, "vectorize": vectorize}
    report = check_gradients(model, _batch(), surrogate, hold_detached=True, **options)
    assert report.verdict == "ok", str(report)
    assert all(p.verdict == "ok" for p in report.probes), str(report)
    assert report.precision == ("float64" if precision == "auto" else "native")
    assert report.vectorized is (True if vectorize else None)
    assert "input" in {p.kind for p in report.probes}  # a held detach cuts no input off
    (note,) = report.noted(NoteCode.DETACHED_HELD)
    assert note.startswith("1 value(s) the loss detaches (in the loss outside the model's forward)")
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_a_wrong_backward_inside_the_model_still_fails_and_is_named() -> None:
    report = check_gradients(Policy(bug=1.03), _batch(), surrogate, hold_detached=True)
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == "gate", str(report)
    assert "input gradient is" in report.culprit_message


def surrogate_of_parts(model: nn.Module, batch: Batch) -> Tensor:
    """:func:`surrogate` with the policy's modules called one by one, not through its forward."""
    x, actions, advantages = batch
    logits = model.head(model.gate(model.second(model.trunk(x))))
    logp = torch.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
    return -(torch.exp(logp - logp.detach()) * advantages).mean()


@pytest.mark.parametrize("loss", [surrogate, surrogate_of_parts], ids=["through-the-model", "its-modules-directly"])
def test_an_accidental_detach_inside_the_model_is_not_held_and_fails(loss: Any) -> None:
    report = check_gradients(Policy(detach=True), _batch(), loss, hold_detached=True)
    assert report.verdict == "fail", str(report)
    failing = {p.target for p in report.probes if p.verdict == "fail" and p.kind in ("tensor", "random", "param")}
    assert failing, str(report)
    assert failing <= {"trunk.first.weight", "trunk.first.bias"}, str(report)
    stopped = "stop-gradient: autograd gives trunk.first.weight, trunk.first.bias no gradient"
    assert any(s.startswith(stopped) for s in report.surrogates)


def test_a_loss_that_detaches_otherwise_than_in_the_reference_is_inconclusive_never_a_fail() -> None:
    calls = []

    def drifting(model: nn.Module, batch: Batch) -> Tensor:
        calls.append(1)
        logp = _log_probs(model, batch)
        old = logp.detach() if len(calls) == 1 else logp.detach() + 0 * logp.detach()  # one detach more after
        return -(torch.exp(logp - old) * batch[2]).mean()

    report = check_gradients(Policy(), _batch(), drifting, hold_detached=True)
    assert report.verdict == "inconclusive", str(report)
    assert not any(p.verdict == "fail" for p in report.probes)
    (note,) = report.noted(NoteCode.DETACHED_MISMATCH)
    assert "it detached more than the 1 tensor(s) of the reference pass" in note


def _applied(model: nn.Module, **options: Any) -> Any:
    batch = _batch()
    surrogate(model, batch).backward()
    return check_applied_gradient(model, [batch], surrogate, **options)


def test_the_applied_check_holds_them_too() -> None:
    assert _applied(Policy(), hold_detached=True).verdict == "ok"
    flat = _applied(Policy())  # the applied gradient against a flat loss: never "ok"
    assert flat.verdict == "inconclusive", str(flat)
    assert {p.reason for p in flat.probes} == {"flat"}, str(flat)
    report = _applied(Policy(bug=1.1), hold_detached=True)
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == "gate", str(report)


class DoraLinearLayer(nn.Module):
    """A DoRA magnitude module as PEFT's (recognised by its name and ``get_weight_norm``): the adapted weight divided
    by its row norm, which is detached by design."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(rows) + 0.5)

    def get_weight_norm(self, weight: Tensor, lora_weight: Tensor) -> Tensor:
        return torch.linalg.norm(weight + lora_weight, dim=1)

    def forward(self, x: Tensor, *, base: Tensor, lora_a: Tensor, lora_b: Tensor) -> Tensor:
        lora_weight = lora_b @ lora_a
        norm = self.get_weight_norm(base, lora_weight.detach()).detach()
        return F.linear(x, base + lora_weight) * (self.weight / norm)


class Adapted(nn.Module):
    """A frozen linear layer with a DoRA adapter, run under activation checkpointing when ``checkpointed``."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("base", torch.randn(8, 6))
        self.lora_a, self.lora_b = nn.Parameter(torch.randn(2, 6)), nn.Parameter(torch.randn(8, 2) * 0.3)
        self.dora = DoraLinearLayer(8)
        self.head = nn.Linear(8, 1)
        self.checkpointed = checkpointed

    def block(self, x: Tensor) -> Tensor:
        return torch.tanh(self.dora(x, base=self.base, lora_a=self.lora_a, lora_b=self.lora_b))

    def forward(self, x: Tensor) -> Tensor:
        h = checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
        return self.head(h).squeeze(-1)


def _regression(model: nn.Module, batch: Batch) -> Tensor:
    return F.mse_loss(model(batch[0]), batch[2])


@pytest.mark.parametrize("checkpointed", [False, True], ids=["eager", "checkpointed"])
def test_a_dora_module_holds_its_weight_norm_and_its_wrong_gradient_still_fails(checkpointed: bool) -> None:
    report = check_gradients(Adapted(checkpointed), _batch(), _regression)
    assert report.verdict == "ok", str(report)
    assert all(p.verdict == "ok" for p in report.probes), str(report)
    (note,) = report.noted(NoteCode.DORA_NORM)
    assert note.startswith("DoRA weight norms of dora held constant")
    buggy = Adapted(checkpointed)
    buggy.dora.weight.register_hook(lambda grad: grad * 1.03)
    report = check_gradients(buggy, _batch(), _regression)
    assert report.verdict == "fail", str(report)
    assert {p.target for p in report.probes if p.verdict == "fail" and p.kind == "tensor"} == {"dora.weight"}
    assert not report.noted(NoteCode.DETACHED_MISMATCH)
    # checkpointed, the search's zero leaf on the constant `base` makes the norm's argument require grad in the
    # recomputation, where the reference held nothing
    assert report.culprits[0] == "dora", str(report)


def test_the_same_detach_outside_a_dora_module_is_not_held() -> None:
    class Plain(Adapted):
        def block(self, x: Tensor) -> Tensor:
            lora_weight = self.lora_b @ self.lora_a
            norm = torch.linalg.norm(self.base + lora_weight, dim=1).detach()
            return torch.tanh(F.linear(x, self.base + lora_weight) * (self.dora.weight / norm))

    report = check_gradients(Plain(False), _batch(), _regression, param_probes=0, random_probes=0)
    assert report.verdict == "fail", str(report)  # the adapters' gradient misses the norm's derivative
    assert {p.target for p in report.probes if p.verdict == "fail" and p.kind == "tensor"} == {"lora_a", "lora_b"}
