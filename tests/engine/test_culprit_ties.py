"""The culprit search at ties (issue 34, culprits never outside the bug): a max-pool over a ReLU's exact zeros has no
derivative with respect to its input, and displaced there directly, the culprit search's input probe of the max-pool
fails for whichever side autograd chose. A weight-gradient bug upstream or downstream of it was named at the max-pool
("its input gradient is 3.4% off while its output gradient is right"); a failing activation probe whose stencil shows a
kink at the point (the one-sided slopes differing by the same amount at two steps) is now a tie, undecided."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradwatch import check_gradients


class PooledCNN(nn.Module):
    """Convolution, BatchNorm, ReLU and max-pool twice, then a classifier: in eval mode, as a fine-tune with frozen
    BatchNorm statistics runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(16 * 4 * 4, 10))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


@pytest.mark.parametrize(
    ("tensor", "module", "named"),
    [("features.0.weight", "features.0", False), ("features.4.weight", "features.4", True)],
)
def test_a_weight_gradient_bug_beside_a_max_pool_over_relu_zeros_is_never_named_at_the_max_pool(
    tensor: str, module: str, named: bool
) -> None:
    """Named at its module after the max-pool; before it, the search cannot pass the tie and names no module (the
    failing tensor probe still says which parameter is wrong), never the max-pool."""
    torch.manual_seed(0)
    model = PooledCNN().eval()
    generator = torch.Generator().manual_seed(1)
    batch = torch.randn(32, 3, 16, 16, generator=generator), torch.randint(0, 10, (32,), generator=generator)
    dict(model.named_parameters())[tensor].register_hook(lambda grad: grad * 1.02)
    report = check_gradients(model, batch, _loss)
    assert report.verdict == "fail"
    assert tensor in {p.target for p in report.failures}
    assert not any(name.startswith("features.3") or name.startswith("features.7") for name in report.culprits)
    if named:
        assert report.culprits[0] == module, report.culprit_message
    else:
        assert not report.culprits or report.culprits[0] == module, report.culprit_message
