"""Complex weights in both kinds of check: a Fourier neural operator's complex spectral weight is probed by the applied
check (as its real view, with its real-view gradient), and a gradient hook that scales that weight's gradient by 5% is
caught by both checks, the float64 recomputation applying the hook as autograd applies it to the complex gradient (no
"float32 only" note)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import library_models as lm

from gradwatch import CheckReport, check_applied_gradient, check_gradients
from gradwatch.engine.results.notes import NoteCode


def _fno(hook: float | None = None) -> lm.FNO:
    torch.manual_seed(0)
    model = lm.FNO()
    if hook is not None:
        model.spectral.weight.register_hook(lambda grad: grad * hook)
    return model


def _applied(model: lm.FNO, batch: tuple[torch.Tensor, torch.Tensor]) -> CheckReport:
    model.zero_grad()
    lm.mse(model, batch).backward()
    grad = model.spectral.weight.grad.clone()
    report = check_applied_gradient(model, [batch], lm.mse, tensor_probes=8)
    assert torch.equal(model.spectral.weight.grad, grad)  # read, never changed
    return report


def test_the_applied_check_probes_a_complex_weight() -> None:
    report = _applied(_fno(), lm.field_batches()[0])
    assert report.verdict == "ok", report
    # the complex weight's share of the descent is measured (it read 0.87 when the weight was left out of the probes)
    assert abs(report.descent_ratio - 1.0) < 1e-6
    assert not any(note.code == NoteCode.APPLIED_UNCHECKED for note in report.notes)


def test_a_hook_scaling_a_complex_weights_gradient_fails_both_checks() -> None:
    batch = lm.field_batches()[0]
    recomputed = check_gradients(_fno(1.05), batch, lm.mse)
    assert recomputed.verdict == "fail", recomputed
    assert "spectral.weight" in {p.target for p in recomputed.failures}
    assert not any(note.code == NoteCode.IMPRECISE_BEYOND_ROUNDING for note in recomputed.notes)
    applied = _applied(_fno(1.05), batch)
    assert (applied.verdict, applied.fault) == ("fail", "formula"), applied
    assert "spectral.weight" in {p.target for p in applied.probes if p.verdict == "fail"}
