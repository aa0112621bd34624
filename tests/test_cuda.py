"""The engine on a GPU: same verdicts, and the CUDA random state is restored too. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from helpers import DropoutBatchNormNet, SeedModel, classification_batch, cross_entropy_loss, seed_batch, seed_loss

from gradwatch import check_gradients

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _to_cuda(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.cuda() for t in batch)


def test_seed_case_on_cuda_ok_and_planted_bug_caught() -> None:
    batch = _to_cuda(seed_batch())
    assert check_gradients(SeedModel().cuda(), batch, seed_loss).verdict == "ok"
    report = check_gradients(SeedModel(weight_scale=1.1).cuda(), batch, seed_loss)
    assert report.verdict == "fail"
    assert {p.target for p in report.failures if p.kind == "param"} == {"fc.weight"}


def test_cuda_dropout_and_batchnorm_state_restored() -> None:
    torch.manual_seed(0)
    model = DropoutBatchNormNet().cuda()
    batch = _to_cuda(classification_batch())
    cross_entropy_loss(model, batch).backward()
    cuda_rng = torch.cuda.get_rng_state()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    report = check_gradients(model, batch, cross_entropy_loss)
    assert report.verdict != "fail", str(report)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert torch.backends.cuda.matmul.allow_tf32 == tf32


def test_cuda_vectorised_passes_measure_what_point_by_point_evaluation_measures() -> None:
    # CUDA draws dropout masks with its own kernels: if a vectorised pass drew others, the pass would not reproduce the
    # centre and the check would fall back to point by point (vectorized False, with a note)
    torch.manual_seed(0)
    model = DropoutBatchNormNet().cuda()
    batch = _to_cuda(classification_batch())
    reports = {
        v: check_gradients(model, batch, cross_entropy_loss, probe_batch_size=4, vectorize=v) for v in (True, False)
    }
    assert reports[True].vectorized is True, reports[True].notes
    assert reports[True].verdict == reports[False].verdict == "ok", str(reports[True])
    for a, b in zip(reports[True].probes, reports[False].probes, strict=True):
        assert a.numeric == pytest.approx(b.numeric, rel=1e-8, abs=1e-12)
