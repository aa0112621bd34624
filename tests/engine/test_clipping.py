"""The clip coefficient against the verified gradient's true norm (issue 33): a wrong one fails with ``"clipping"``."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import torch
from torch import nn
from two_processes import needs_gloo, run_ranks

from gradwatch.engine.applied.clipping import GradientNorms, check_clip_norm, check_clipping
from gradwatch.engine.results.notes import NoteCode


def _gradients(seed: int = 0) -> list[nn.Parameter]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    nn.functional.cross_entropy(model(x), y).backward()
    return list(model.parameters())


@pytest.mark.parametrize("max_norm", [1e-3, 0.05, 1e3])
def test_clip_grad_norm_is_clean_whether_it_clips_or_not(max_norm: float) -> None:
    params = _gradients()
    verified = GradientNorms.of([p.grad for p in params])
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    report = check_clipping(verified, [p.grad for p in params], max_norm)
    assert (report.verdict, report.fault) == ("ok", None), report.fault_message
    assert report.scope == "applied"
    assert report.noted(NoteCode.APPLIED_CLIPPING)


def test_the_textbook_coefficient_without_epsilon_is_clean_too() -> None:
    params = _gradients()
    before = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in before]))
    clipped = [g * (1e-2 / norm) for g in before]
    assert check_clipping(before, clipped, 1e-2).verdict == "ok"


def test_a_coefficient_scaled_by_two_fails_with_both_norms() -> None:
    params = _gradients()
    verified = GradientNorms.of([p.grad for p in params])
    torch.nn.utils.clip_grad_norm_(params, 0.05)
    for p in params:
        p.grad.mul_(2)  # type: ignore[union-attr]
    report = check_clipping(verified, [p.grad for p in params], 0.05)
    assert report.verdict == "fail"
    assert report.fault == "clipping"
    expected = 0.05 / (verified.total + 1e-6)
    assert f"{verified.total:.6g}" in report.fault_message
    assert "max_norm 0.05" in report.fault_message
    applied, wanted = map(float, re.findall(r"clipped by (\S+) where .* give (\S+):", report.fault_message)[0])
    assert wanted == pytest.approx(expected, rel=1e-5)
    assert applied == pytest.approx(2 * expected, rel=1e-5)


def test_tensors_clipped_separately_fail() -> None:
    params = _gradients()
    verified = GradientNorms.of([p.grad for p in params])
    for p in params:
        torch.nn.utils.clip_grad_norm_([p], 0.05)  # per tensor: each by its own norm
    report = check_clipping(verified, [p.grad for p in params], 0.05)
    assert report.verdict == "fail"
    assert report.fault == "clipping"


def test_bad_arguments_are_named() -> None:
    params = _gradients()
    grads = [p.grad for p in params]
    with pytest.raises(ValueError, match="max_norm"):
        check_clipping(grads, grads, 0.0)
    with pytest.raises(ValueError, match="clipped"):
        check_clipping(grads, grads[:2], 1.0)
    with pytest.raises(TypeError, match="grads"):
        check_clipping(grads, 3, 1.0)  # type: ignore[arg-type]


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.slow
@needs_gloo
def test_ddp_norm_over_one_rank_only_is_caught_and_correct_clipping_is_clean(tmp_path: Path) -> None:
    found, _ = run_ranks("clipping_ddp_run.py", tmp_path, _free_port(), timeout_s=120)
    for rank in (0, 1):
        correct, wrong = found[f"correct_rank{rank}"], found[f"one_rank_rank{rank}"]
        assert (correct["verdict"], correct["fault"]) == ("ok", None), correct
        assert (wrong["verdict"], wrong["fault"]) == ("fail", "clipping"), wrong
        assert f"{wrong['total']:.6g}" in wrong["message"]


def test_the_norm_an_engine_clipped_with_is_held_against_the_verified_norm() -> None:
    """DeepSpeed clips the partitions it keeps: the norm it says it clipped with must give the true coefficient."""
    verified = GradientNorms.of([torch.full((4,), 3.0), torch.full((3,), 4.0)])  # ‖g‖ = sqrt(36 + 48)
    true = verified.total
    assert check_clip_norm(verified, true, max_norm=1.0, step=3).verdict == "ok"
    assert check_clip_norm(verified, true * (1 + 1e-7), max_norm=1.0).verdict == "ok"  # rounding of another order
    report = check_clip_norm(verified, 2 * true, max_norm=1.0, step=3)
    assert (report.step, report.verdict, report.fault) == (3, "fail", "clipping")
    assert f"{2 * true:.6g}" in report.fault_message
    # below the threshold both coefficients are 1: a wrong norm that changes nothing is no wrong gradient
    assert check_clip_norm(verified, 2 * true, max_norm=100.0).verdict == "ok"
    with pytest.raises(ValueError, match="`max_norm` must be a positive number"):
        check_clip_norm(verified, true, max_norm=0.0)


def test_a_float32_norm_of_millions_of_elements_clips_cleanly() -> None:
    # the Trainer's clip_grad_norm_ takes a float32 norm, which on a CPU is off by far more than float32's epsilon for
    # a tensor of millions of elements (an embedding's gradient at 0.5B parameters: 3e-3): no false alarm for that
    torch.manual_seed(0)
    params = [nn.Parameter(torch.zeros(4_000_000)), nn.Parameter(torch.zeros(300))]
    for p in params:
        p.grad = torch.randn_like(p)
    float32_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    verified = GradientNorms.of([p.grad for p in params])
    assert abs(float(float32_norm) / verified.total - 1) > 2e-5  # the case: beyond the tolerance of 1e-5
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    report = check_clipping(verified, [p.grad for p in params], 1.0)
    assert (report.verdict, report.fault) == ("ok", None), report.fault_message
    for p in params:
        p.grad.mul_(1.001)  # type: ignore[union-attr]
    assert check_clipping(verified, [p.grad for p in params], 1.0).fault == "clipping"
