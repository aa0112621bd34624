"""assert_gradients_ok: passes on correct gradients, fails with a readable table on wrong ones."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from helpers import SeedModel, classification_batch, cross_entropy_loss, seed_batch, seed_loss
from torch import nn

from gradwatch.cli.demo_models import RMSNorm
from gradwatch.testing import assert_gradients_ok


def test_correct_gradients_pass_and_return_the_report() -> None:
    report = assert_gradients_ok(SeedModel(), seed_batch(), seed_loss, param_probes=3, input_probes=0)
    assert report.verdict == "ok"
    assert [p.kind for p in report.probes].count("param") == 3  # keyword arguments reach check_gradients
    assert [p.kind for p in report.probes].count("input") == 0


def test_wrong_gradient_raises_with_a_table_of_the_failing_probes() -> None:
    with pytest.raises(AssertionError) as error:
        assert_gradients_ok(SeedModel(weight_scale=1.1), seed_batch(), seed_loss)
    message = str(error.value)
    first, counts, header, rule, *rows = (line.strip() for line in message.splitlines())
    # the culprit first: the model's forward reads fc's weights through a custom Function, fc never runs
    culprit = "the backward of `<model>` (`SeedModel`) is wrong: the gradient of the parameters it reads (`fc.weight`"
    assert first.startswith(f"gradient check failed at step 0: {culprit}"), first
    assert re.match(r"\(\d+ of \d+ probes failed; descent ratio 0\.9", counts)
    assert header.split() == ["kind", "tensor[index]", "analytic", "numeric", "rel.", "error", "noise", "reason"]
    assert set(rule) == {"-", " "}
    # the check's notes follow the table, and the count of the culprit search's failing probes
    rows = [row for row in rows if not row.startswith(("note: ", "(and "))]
    assert rows
    assert all(row.split()[-1] == "discrepancy" for row in rows)
    assert any(row.startswith("param") and "fc.weight[" in row for row in rows)
    assert not any("fc.bias[" in row for row in rows)  # the bias gradient is right


def test_a_custom_function_with_a_wrong_backward_in_float64() -> None:
    torch.manual_seed(0)

    def model(correct: bool) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), RMSNorm(32, correct_backward=correct), nn.Linear(32, 4)).double()

    inputs, labels = classification_batch()
    batch = (inputs.double(), labels)
    report = assert_gradients_ok(model(True), batch, cross_entropy_loss, allow_inconclusive=False)
    assert report.verdict == "ok"
    with pytest.raises(AssertionError, match=r"0\.weight\[|0\.bias\[|batch\[0\]\["):
        assert_gradients_ok(model(False), batch, cross_entropy_loss)


def test_inconclusive_passes_unless_disallowed() -> None:
    def noisy_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # a private generator: randomness gradwatch cannot replay, so no probe can tell
        inputs, labels = batch
        return F.cross_entropy(model(inputs + torch.randn(inputs.shape, generator=generator)), labels)

    generator = torch.Generator().manual_seed(0)
    report = assert_gradients_ok(nn.Linear(16, 4), classification_batch(), noisy_loss)
    assert report.verdict == "inconclusive"
    with pytest.raises(AssertionError, match=r"inconclusive: no probe failed.*\(allow_inconclusive=False\)"):
        assert_gradients_ok(nn.Linear(16, 4), classification_batch(), noisy_loss, allow_inconclusive=False)
