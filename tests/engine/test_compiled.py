"""Compiled models: the check runs compiled code eagerly, and compares the training's compiled gradient with eager
autograd's, so a wrong compiled backward fails without a single recompilation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import classification_batch
from torch import Tensor, nn

from gradwatch import check_gradients
from gradwatch.engine.recomputed.compiled import compiled_parts
from gradwatch.engine.results.notes import NoteCode


class WrongWhenCompiled(torch.autograd.Function):
    """The identity, whose backward scales the gradient by ``factor`` only when dynamo traces it: a bug that lives in
    the compiled backward alone."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * (ctx.factor if torch.compiler.is_compiling() else 1.0), None


class Net(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(16, 32), nn.Linear(32, 4)
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return self.last(WrongWhenCompiled.apply(torch.tanh(self.first(x)), self.factor))


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _compiled_and_trained_once(factor: float) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    torch.manual_seed(0)
    model = torch.compile(Net(factor))
    batch = classification_batch()
    _loss(model, batch).backward()  # the training step that compiles the graph
    return model, batch


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    import torch._dynamo

    torch._dynamo.reset()


def test_compiled_parts_are_found() -> None:
    model, _ = _compiled_and_trained_once(1.0)
    assert compiled_parts(model) == ["OptimizedModule"]
    inner = Net(1.0)
    inner.compile()
    assert compiled_parts(nn.Sequential(inner)) == ["0"]
    assert compiled_parts(Net(1.0)) == []


def test_a_correct_compiled_model_agrees_without_recompiling() -> None:
    model, batch = _compiled_and_trained_once(1.0)
    graphs = _graphs()
    report = check_gradients(model, batch, _loss)
    assert report.verdict == "ok", str(report)
    (compiled,) = [p for p in report.probes if p.kind == "compiled"]
    assert (compiled.target, compiled.verdict) == ("*", "ok")
    assert compiled.rel_error < 1e-5
    assert _graphs() == graphs


def test_a_wrong_compiled_backward_fails_and_names_the_tensors_it_reaches() -> None:
    model, batch = _compiled_and_trained_once(1.03)
    graphs = _graphs()
    report = check_gradients(model, batch, _loss)
    assert report.verdict == "fail", str(report)
    failing = {p.target for p in report.failures}
    assert failing == {"_orig_mod.first.weight", "_orig_mod.first.bias"}
    assert all(p.kind == "compiled" and p.rel_error == pytest.approx(0.03 / 1.03, rel=1e-3) for p in report.failures)
    # the eager probes agree: the eager backward is right
    assert all(p.verdict == "ok" for p in report.probes if p.kind != "compiled")
    assert _graphs() == graphs


def test_a_batch_the_graph_was_not_compiled_for_is_not_compiled_for_the_check() -> None:
    model, batch = _compiled_and_trained_once(1.0)
    graphs = _graphs()
    other = (batch[0][:5], batch[1][:5])
    report = check_gradients(model, other, _loss)
    assert report.noted(NoteCode.COMPILED_WOULD_RECOMPILE), report.notes
    assert not [p for p in report.probes if p.kind == "compiled"]
    assert _graphs() == graphs


def test_a_wrong_compiled_backward_names_the_compiled_module() -> None:
    model, batch = _compiled_and_trained_once(1.03)
    report = check_gradients(model, batch, _loss)
    assert report.culprits == [""], str(report)  # the model itself is the compiled module
    assert report.culprit_message.startswith("the compiled backward of `<model>` (`OptimizedModule`) is wrong")
    torch._dynamo.reset()
    torch.manual_seed(0)
    inner = Net(1.03)
    inner.compile()
    outer = nn.Sequential(nn.Linear(16, 16), inner)
    _loss(outer, batch).backward()
    report = check_gradients(outer, batch, _loss)
    assert report.verdict == "fail", str(report)
    assert report.culprits == ["1", ""], str(report)
    assert report.culprit_message.startswith("the compiled backward of `<model>[1]` (`Net`) is wrong")
