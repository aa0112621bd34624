"""Float64 reductions: same semantics as torch's, less rounding, and a safe fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradwatch.engine.function.reductions import Float64Reductions


def _losses() -> list[tuple[str, object]]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    x, y = randn(6, 5), randn(6, 5)
    probabilities = torch.rand(6, 5, generator=generator, dtype=torch.float64)
    classes = torch.tensor([0, 1, 4, -100, 2, 2])
    weight = torch.rand(5, generator=generator, dtype=torch.float64) + 0.1
    calls: list[tuple[str, object]] = [
        ("sum", lambda: x.sum()),
        ("torch.sum", lambda: torch.sum(x)),
        ("mean", lambda: x.mean()),
        ("torch.mean", lambda: torch.mean(x)),
        ("mse mean", lambda: F.mse_loss(x, y)),
        ("mse sum", lambda: nn.MSELoss(reduction="sum")(x, y)),
        ("l1", lambda: F.l1_loss(x, y)),
        ("smooth l1", lambda: F.smooth_l1_loss(x, y, beta=0.5)),
        ("huber", lambda: F.huber_loss(x, y, delta=0.7)),
        ("bce", lambda: F.binary_cross_entropy(torch.sigmoid(x), probabilities)),
        ("bce logits", lambda: F.binary_cross_entropy_with_logits(x, probabilities, pos_weight=weight)),
        ("soft margin", lambda: F.soft_margin_loss(x, y.sign())),
        ("poisson", lambda: F.poisson_nll_loss(x, probabilities)),
        ("gaussian", lambda: F.gaussian_nll_loss(x, y, probabilities + 0.1)),
        ("kl batchmean", lambda: F.kl_div(x.log_softmax(1), probabilities.softmax(1), reduction="batchmean")),
        ("kl mean", lambda: F.kl_div(x.log_softmax(1), probabilities.softmax(1), reduction="mean")),
        ("ce ignore", lambda: F.cross_entropy(x, classes)),
        ("ce weight", lambda: F.cross_entropy(x, classes, weight=weight)),
        ("ce smoothing", lambda: F.cross_entropy(x, classes, label_smoothing=0.1)),
        ("ce probabilities", lambda: F.cross_entropy(x, probabilities.softmax(1))),
        ("nll weight", lambda: F.nll_loss(x.log_softmax(1), classes, weight=weight)),
        ("ce sum", lambda: F.cross_entropy(x, classes, reduction="sum")),
    ]
    return calls


@pytest.mark.filterwarnings("ignore:reduction. 'mean' divides the total loss:UserWarning")
@pytest.mark.parametrize("name", [name for name, _ in _losses()])
def test_float64_reductions_reproduce_torch_semantics(name: str) -> None:
    # in float64 the precise path must give torch's own value: a mistaken denominator would show at once
    call = dict(_losses())[name]
    native = call()
    with Float64Reductions(verify=True) as mode:
        precise = call()
    assert mode.mismatch is None
    assert precise.dtype == torch.float64
    assert precise.item() == pytest.approx(native.item(), rel=1e-12, abs=1e-15)


def test_float32_sum_is_accumulated_in_float64() -> None:
    x = torch.full((10**6,), 0.1, dtype=torch.float32)
    exact = 10**6 * float(torch.tensor(0.1, dtype=torch.float32))
    with Float64Reductions():
        precise = x.sum()
    assert precise.dtype == torch.float64
    assert abs(precise.item() - exact) < 1e-6
    assert abs(x.sum().item() - exact) > abs(precise.item() - exact)


def test_partial_reductions_and_explicit_dtypes_are_left_alone() -> None:
    x = torch.randn(4, 3)
    with Float64Reductions():
        assert x.sum(dim=0).dtype == torch.float32
        assert x.sum(dtype=torch.float32).dtype == torch.float32
        assert F.mse_loss(x, x, reduction="none").dtype == torch.float32
        assert torch.randint(0, 5, (4,)).sum().dtype == torch.int64


def test_verification_falls_back_to_native_on_a_semantic_mismatch() -> None:
    # mse_loss with a weight divides its mean by the weights' sum in some torch versions: left native, never guessed
    x, y, w = torch.randn(4, 3), torch.randn(4, 3), torch.rand(4, 3)
    with Float64Reductions(verify=True) as mode:
        result = F.mse_loss(x, y, weight=w)
    assert result.dtype == torch.float32
    assert mode.mismatch is None

    mode = Float64Reductions(verify=True)
    agrees = mode._agrees(torch.tensor(1.0), torch.tensor(1.001, dtype=torch.float64), torch.ones(10), 10.0)
    assert not agrees
