"""Kernels that refuse float64 (Triton, fused CUDA kernels): both checks probe natively, conclude, and name the
kernel's module as the culprit."""

from __future__ import annotations

from native_models import NativeMLP, native_batch, native_loss
from torch import Tensor

from gradwatch import check_gradients
from gradwatch.engine.applied.check import check_applied_gradient


def _accumulated(model: NativeMLP) -> list[tuple[Tensor, Tensor]]:
    batches = [native_batch(0), native_batch(1)]
    for batch in batches:
        (native_loss(model, batch) / len(batches)).backward()
    return batches


def test_a_recomputed_check_names_the_float32_only_kernel() -> None:
    healthy = check_gradients(NativeMLP(), native_batch(), native_loss, step=1)
    assert healthy.verdict == "ok", str(healthy)
    assert healthy.precision == "native"
    report = check_gradients(NativeMLP(1.03), native_batch(), native_loss, step=1)
    assert report.verdict == "fail", str(report)
    assert report.precision == "native"
    assert report.culprits[0] == "up", report.culprit_message  # not `<loss>`, not the model


def test_an_applied_check_without_float64_kernels_measures_its_floor_and_concludes() -> None:
    """It once crashed (``TypeError: 'float' object is not iterable``: a max over no measured floors)."""
    model = NativeMLP()
    healthy = check_applied_gradient(model, _accumulated(model), native_loss)
    assert healthy.verdict == "ok", str(healthy)
    model = NativeMLP(1.03)
    report = check_applied_gradient(model, _accumulated(model), native_loss)
    assert report.verdict == "fail", str(report)
    assert report.culprits[0] == "up", report.culprit_message
    # the floor a failing probe needs is measured without float64: the float32 backward's own rounding
    assert any("backward's own rounding" in note for note in report.notes), report.notes
