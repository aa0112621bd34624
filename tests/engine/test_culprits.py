"""The culprit of a failing check: the module whose backward is wrong, not the victims upstream of it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradwatch import check_gradients
from gradwatch.cli.demo_models import CustomNormClassifier, DetachedPenaltyClassifier, ScaledGradClassifier
from gradwatch.engine.culprits.search import LOSS
from gradwatch.testing import assert_gradients_ok

SEARCH_KINDS = ("activation", "module_input", "module_params")


class WrongInputGradient(torch.autograd.Function):
    """``tanh`` whose backward scales the input gradient by ``factor`` (1 is correct)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, float], output: Tensor) -> None:  # type: ignore[override]
        ctx.save_for_backward(output)
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y) * ctx.factor, None


class Tanh(nn.Module):
    """A hand-written ``tanh``; ``factor`` plants a bug in its backward."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return WrongInputGradient.apply(x, self.factor)


class Block(nn.Module):
    def __init__(self, width: int, factor: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = Tanh(factor)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x + self.act(self.fc(x)))  # a residual stream: the error reaches upstream by two paths


class Stack(nn.Module):
    def __init__(self, depth: int = 6, bug_at: int | None = None, width: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width, 1.03 if i == bug_at else 1.0) for i in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=generator), torch.randint(0, 3, (6,), generator=generator)


def _cross_entropy(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


@pytest.mark.parametrize("bug_at", [0, 3, 5], ids=["first", "middle", "last"])
def test_the_module_whose_backward_is_wrong_is_named_not_its_victims(bug_at: int) -> None:
    report = check_gradients(Stack(bug_at=bug_at), _batch(), _cross_entropy)
    assert report.verdict == "fail", str(report)
    assert report.culprits[:2] == [f"blocks.{bug_at}.act", f"blocks.{bug_at}"], str(report)
    assert report.culprit_message.startswith(f"the backward of `blocks.{bug_at}.act` (`Tanh`) is wrong: its input")
    assert "while its output gradient is right" in report.culprit_message
    search = [p for p in report.probes if p.kind in SEARCH_KINDS]
    assert search
    assert all(p.target for p in search if p.target != "")


def test_a_healthy_check_makes_no_search() -> None:
    report = check_gradients(Stack(), _batch(), _cross_entropy)
    assert report.verdict == "ok", str(report)
    assert report.culprits == []
    assert report.culprit_message == ""
    assert not any(p.kind in SEARCH_KINDS for p in report.probes)


class WrongLossGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor) -> Tensor:
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad * 1.03


def test_a_wrong_backward_in_the_loss_itself_is_named_as_the_loss() -> None:
    def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        return F.cross_entropy(WrongLossGradient.apply(model(batch[0])), batch[1])

    report = check_gradients(Stack(), _batch(), loss)
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == LOSS, str(report)
    assert report.culprit_message.startswith("the loss's own backward is wrong"), report.culprit_message


class Functional(nn.Module):
    """A bug in plain functional code between two modules of the model's own forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 12)
        self.second = nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(WrongInputGradient.apply(self.first(x), 1.03))


def test_a_bug_in_functional_code_names_the_smallest_module_containing_it() -> None:
    report = check_gradients(Functional(), _batch(), _cross_entropy)
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == "", str(report)
    assert "in its own code between `first` and `second`" in report.culprit_message, report.culprit_message


class Shared(nn.Module):
    """One buggy module called twice (shared weights), between two healthy ones."""

    def __init__(self, factor: float = 1.03) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 12)
        self.shared = nn.Sequential(nn.Linear(12, 12), Tanh(factor))
        self.out = nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.shared(self.shared(self.inp(x))))


def test_a_shared_module_called_twice_is_named() -> None:
    report = check_gradients(Shared(), _batch(), _cross_entropy)
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == "shared.1", str(report)


class PairOutput(nn.Module):
    """Returns ``(values, indices)``: a floating and an integer output."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.act = Tanh(factor)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = self.act(x)
        return y, y.argmax(-1)


class TupleModel(nn.Module):
    def __init__(self, factor: float = 1.03) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 12)
        self.pair = PairOutput(factor)
        self.out = nn.Sequential(nn.Linear(12, 3), nn.ReLU(inplace=True))  # in place on the activation probed

    def forward(self, x: Tensor) -> Tensor:
        values, indices = self.pair(self.inp(x))
        return self.out(values) + 0.0 * indices.unsqueeze(-1)


def test_a_module_with_tuple_and_integer_outputs_is_named() -> None:
    report = check_gradients(TupleModel(), _batch(), _cross_entropy)
    assert report.verdict == "fail", str(report)
    assert report.culprits[:2] == ["pair.act", "pair"], str(report)
    healthy = check_gradients(TupleModel(factor=1.0), _batch(), _cross_entropy)
    assert healthy.verdict == "ok", str(healthy)


def _classifier_loss(module: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    return module.training_step(batch, 0)  # type: ignore[operator]


def _classification() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(2)
    return torch.randn(16, 32, generator=generator), torch.randint(0, 4, (16,), generator=generator)


def test_the_demo_rmsnorm_is_named() -> None:
    torch.manual_seed(0)
    report = check_gradients(CustomNormClassifier(correct_backward=False), _classification(), _classifier_loss)
    assert report.culprits == ["net.1", "net", ""], str(report)
    assert report.culprit_message.startswith("the backward of `net.1` (`RMSNorm`) is wrong: its input gradient is")


def test_a_wrong_parameter_gradient_names_its_module() -> None:
    torch.manual_seed(0)
    report = check_gradients(ScaledGradClassifier(1.01), _classification(), _classifier_loss)
    assert report.culprits == ["net.4"], str(report)
    assert "the gradient of its parameters is" in report.culprit_message


def test_parameters_used_outside_their_modules_name_the_loss() -> None:
    torch.manual_seed(0)
    report = check_gradients(DetachedPenaltyClassifier(), _classification(), _classifier_loss)
    assert report.culprits == [LOSS], str(report)
    assert "outside their modules" in report.culprit_message


def test_assert_gradients_ok_leads_with_the_culprit() -> None:
    with pytest.raises(AssertionError, match=r"^the backward of `blocks\.3\.act` \(`Tanh`\) is wrong"):
        assert_gradients_ok(Stack(bug_at=3), _batch(), _cross_entropy)


def test_hooks_are_removed_whatever_happens() -> None:
    model = Stack(bug_at=2)
    check_gradients(model, _batch(), _cross_entropy)
    for module in model.modules():
        assert not module._forward_hooks
        assert not module._forward_pre_hooks
