"""Norms that survive tiny and huge values, and float64 accumulations."""

from __future__ import annotations

import math

import pytest
import torch

from gradwatch.engine.numerics.norms import dot, norms, rms


def test_norms_match_float64_from_tiny_to_huge_and_for_16_bit_tensors() -> None:
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(1000, generator=generator)
    tensors = [
        base,
        base * 1e-25,  # float32 squares underflow: recomputed in float64
        torch.zeros(10),
        base * 1e25,  # float32 squares overflow
        base.double() * 1e-200,
        base.to(torch.bfloat16),
        torch.empty(0),
    ]
    expected = [torch.linalg.vector_norm(t.double()).item() for t in tensors]
    for exact in (False, True):
        assert norms(tensors, exact=exact) == pytest.approx(expected, rel=1e-5 if not exact else 1e-12)


def test_exact_norms_are_float64_accumulations() -> None:
    values = torch.full((10_000,), 1.0 + 2**-20)  # float32 accumulation drifts in the last digits
    (value,) = norms([values], exact=True)
    assert value == pytest.approx(math.sqrt(10_000) * (1 + 2**-20), rel=1e-14)


def test_dot_and_rms_accumulate_in_float64_from_16_bit_tensors() -> None:
    a = torch.full((4096,), 1.0 + 2**-7, dtype=torch.bfloat16)
    assert dot(a, a).dtype == torch.float64
    assert dot(a, a).item() == pytest.approx(4096 * (1 + 2**-7) ** 2, rel=1e-12)
    assert rms(torch.full((3, 3), 2.0), torch.full((7,), 2.0)) == pytest.approx(2.0, rel=1e-6)
    assert rms() == 0.0
