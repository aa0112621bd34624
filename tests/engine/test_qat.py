"""Quantisation-aware training as ``torch.ao.quantization`` prepares it (``fuse_modules_qat`` and ``prepare_qat``: fused
fake quantisers on the weights, activation quantisers run by forward hooks): a recomputed check runs every quantiser as
the identity and concludes on every parameter, in float64, leaving the model as it was."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from gradwatch import check_gradients
from gradwatch.engine.results.notes import NoteCode

quantization = pytest.importorskip("torch.ao.quantization")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = quantization.QuantStub(), quantization.DeQuantStub()
        self.fc1, self.relu, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))


def _prepared() -> nn.Module:
    torch.manual_seed(0)
    model = _Net().train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation, observers' reduce_range
        model.qconfig = quantization.get_default_qat_qconfig("fbgemm")
        quantization.fuse_modules_qat(model, [["fc1", "relu"]], inplace=True)
        quantization.prepare_qat(model, inplace=True)
    return model


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_a_prepared_qat_model_is_checked_everywhere_but_its_quantisers() -> None:
    model = _prepared()
    batch = (torch.randn(16, 8), torch.randint(0, 3, (16,)))
    for _ in range(3):  # the observers see batches first, as in training
        _loss(model, batch)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    report = check_gradients(model, batch, _loss)
    assert report.verdict == "ok", report
    assert report.count("inconclusive") == 0, report
    assert report.precision == "float64"
    assert {"fc1.weight", "fc2.weight"} <= {p.target for p in report.probes}
    assert report.noted(NoteCode.FAKE_QUANTISATION)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert not any("forward" in vars(module) for module in model.modules())
