"""Module names as a reader types them, in the culprit's words; the names code reads stay ``named_modules()``'s."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gradwatch import check_gradients
from gradwatch.engine.results.naming import display_name, named_module


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("", "<model>"),
        ("net.2", "net[2]"),
        ("blocks.0.norm", "blocks[0].norm"),
        ("layers.10.attn.q_proj", "layers[10].attn.q_proj"),
        ("2", "<model>[2]"),
        ("0.1", "<model>[0][1]"),
        ("encoder.fc", "encoder.fc"),
    ],
    ids=["model", "sequential-child", "nested", "two-digits", "child-of-a-sequential-model", "nested-index", "plain"],
)
def test_display_names(name: str, shown: str) -> None:
    assert display_name(name) == shown
    assert named_module(name, "Linear") == f"`{shown}` (`Linear`)"


class _HalfWeightGradient(torch.autograd.Function):
    """A linear map whose backward halves the weight's gradient: a wrong backward inside one module."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, Tensor]:
        x, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad @ weight, 0.5 * grad.t() @ x


class _Buggy(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return _HalfWeightGradient.apply(x, self.weight) + self.bias


def test_a_sequential_child_is_named_by_its_index_with_its_class() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), _Buggy(8, 3))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    report = check_gradients(model, (x, y), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == "2"  # as model.get_submodule takes it
    assert report.culprit_message.startswith("the backward of `<model>[2]` (`_Buggy`) is wrong"), report.culprit_message
    assert "``" not in report.culprit_message  # the model is never named by an empty name
