"""An applied check of a small trainable part of a large frozen model (LoRA on a billion parameters): float64 probes
without a float64 copy of the frozen parameters, the verdicts as with one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from applied_models import MLP, batch_for, bf16, cross_entropy, train_window

from gradwatch.engine.applied import probes
from gradwatch.engine.function import precision


def _frozen_base() -> MLP:
    torch.manual_seed(0)
    model = MLP()
    model.fc1.requires_grad_(False)  # the frozen base; fc2 is the trainable part
    return model


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[set[int]]:
    """The parameters each float64 evaluation of the applied probes gave a float64 copy, with the float64 limit
    lowered below this model's size (as a 0.5B model is above the real one)."""
    made: list[set[int]] = []
    storage = precision.float64_storage

    def recording(model: torch.nn.Module, moved: set[int] | None = None):  # type: ignore[no-untyped-def]
        made.append({id(p) for p in model.parameters()} if moved is None else set(moved))
        return storage(model, moved)

    monkeypatch.setattr(probes, "AUTO_FLOAT64_ELEMENTS", 100)
    monkeypatch.setattr(probes, "float64_storage", recording)
    return made


def test_only_the_trainable_parameters_get_float64_copies_and_a_healthy_model_passes(copies: list[set[int]]) -> None:
    model = _frozen_base()
    window = train_window(model, [batch_for(model, seed=1), batch_for(model, seed=2)], bf16)
    report = window.check(cross_entropy, path=bf16)
    assert (report.verdict, report.precision) == ("ok", "float64"), str(report)
    assert copies
    assert all(made == {id(model.fc2.weight), id(model.fc2.bias)} for made in copies)


def test_a_wrong_gradient_of_the_trainable_part_is_still_caught(copies: list[set[int]]) -> None:
    model = _frozen_base()
    handle = model.fc2.weight.register_hook(lambda grad: grad * 1.02)
    try:
        window = train_window(model, [batch_for(model, seed=1)])
        report = window.check(cross_entropy)
    finally:
        handle.remove()
    assert (report.verdict, report.fault, report.precision) == ("fail", "formula", "float64")
    assert [p.target for p in report.failures if p.kind == "tensor"] == ["fc2.weight"]
    assert all(made <= {id(model.fc2.weight), id(model.fc2.bias)} for made in copies)
