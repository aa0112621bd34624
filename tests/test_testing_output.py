"""What a user's test shows when ``assert_gradients_ok`` fails in pytest: the failure in a few lines (the culprit, the
failing probes), not the helper's own source and arguments."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

USER_TEST = """
import torch
from torch import nn

from gradwatch.testing import assert_gradients_ok


class WrongSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2.2 * x * grad  # the derivative of x * x is 2 * x


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 8)
        self.outer = nn.Linear(8, 1)

    def forward(self, x):
        return self.outer(WrongSquare.apply(self.inner(x)))


def test_my_backward():
    torch.manual_seed(0)
    model = Model().double()
    batch = torch.randn(16, 4, dtype=torch.float64)
    assert_gradients_ok(model, batch, lambda model, x: model(x).pow(2).mean())
"""


@pytest.mark.slow  # a pytest run in a subprocess
def test_a_failing_assertion_shows_the_failure_not_the_helper(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(USER_TEST)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_user.py"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False)
    output = done.stdout
    assert done.returncode == 1, output[-3000:]
    assert "AssertionError: gradient check failed at step 0: the backward of `<model>`" in output  # the culprit leads
    assert "inner.weight" in output  # a failing probe names the tensor
    assert "def assert_gradients_ok" not in output  # the helper's source
    assert "check_kwargs = " not in output  # the helper's arguments
    assert len(output.splitlines()) <= 40, output
