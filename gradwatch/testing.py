"""An assertion for unit tests: the gradients of a model (custom autograd Functions included) are the derivatives of
its loss.

Example::

    from gradwatch.testing import assert_gradients_ok

    def test_my_layer_backward():
        model = nn.Sequential(nn.Linear(8, 16), MyCustomLayer(16))
        batch = torch.randn(32, 8)
        assert_gradients_ok(model, batch, lambda model, x: model(x).pow(2).mean())
"""

from __future__ import annotations

from typing import Any

from torch import nn

from gradwatch.engine import CheckReport, LossFn, check_gradients
from gradwatch.engine.results.rendering import probe_table, render_text

__all__ = ["assert_gradients_ok", "probe_table"]


def assert_gradients_ok(
    model: nn.Module, batch: Any, loss_fn: LossFn, *, allow_inconclusive: bool = True, **check_kwargs: Any
) -> CheckReport:
    """Assert that autograd's gradient of ``loss_fn(model, batch)`` is the derivative of the loss; return the report.

    Runs :func:`gradwatch.check_gradients` once (all keyword arguments besides ``allow_inconclusive`` go to it, e.g.
    ``param_probes``, ``input_probes``, ``rtol``, ``seed``) and raises :class:`AssertionError` with a table of the
    failing probes (kind, tensor and index, analytic and numeric derivative, relative error, noise, reason) when the
    verdict is ``"fail"``.

    A check can also be ``"inconclusive"``: no probe failed, but none could confirm the gradient either (every probe
    crossed a kink or drowned in round-off). With ``allow_inconclusive=True`` (the default) that passes, since nothing
    was found wrong; pass ``False`` to require a positive confirmation, e.g. for a smooth model in float64, where an
    inconclusive check means the test itself is too weak.

    Tips for reliable tests: use float64 (``model.double()`` and a float64 batch) where the model supports it, a
    batch of a few dozen samples, and more probes (``param_probes=32``) for a layer with many parameters.

    Args:
        model: The module whose trainable parameters are checked (it is left exactly as it was).
        batch: Anything ``loss_fn`` accepts; its floating tensors are probed as inputs.
        loss_fn: ``loss_fn(model, batch) -> scalar Tensor``.
        allow_inconclusive: Whether an inconclusive check passes.
        **check_kwargs: Passed to :func:`gradwatch.check_gradients`.

    Returns:
        The :class:`~gradwatch.CheckReport` of the check, for further assertions.

    Raises:
        AssertionError: The check failed (or was inconclusive and ``allow_inconclusive`` is false).
    """
    __tracebackhide__ = True  # pytest shows the assertion, not this helper's source
    report = check_gradients(model, batch, loss_fn, **check_kwargs)
    if report.verdict == "fail":
        raise AssertionError(render_text(report, limit=None, prefix="", table=True))
    if report.verdict == "inconclusive" and not allow_inconclusive:
        notes = "".join(f"\nnote: {note}" for note in report.notes)
        raise AssertionError(
            f"gradient check inconclusive: no probe failed, but none confirmed the gradient "
            f"(allow_inconclusive=False)\n{probe_table(report.probes)}{notes}"
        )
    return report
