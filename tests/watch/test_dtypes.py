"""Every dtype a model's parameters and buffers can have, under a GradientWatch at its defaults with both kinds of
check (and the clip coefficient's): complex spectral weights (an FNO, checked as real/imaginary pairs), a frozen
float8 weight and a float8 buffer, integer buffers. The run completes, trains bit for bit as without the watch, and no
check fails a correct model."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from dtype_models import FNO, QuantisedSide, field_batches, field_loss
from loop_models import assert_same_state, state_of
from torch import nn

from gradwatch import GradientCheckWarning, GradientWatch

MAX_NORM = 0.05  # small enough that the loop clips: the clip coefficient is checked


def _regression_batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(count)]


def _train(make: Callable[[], nn.Module], batches: list[Any], watch: GradientWatch | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step, batch in enumerate(batches, start=1):
        if watch is not None:
            watch.record(batch)
        field_loss(model, batch).backward()
        if watch is not None:
            watch.before_optimizer_step(model, field_loss, step=step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if watch is not None:
            watch.after_clipping(model, MAX_NORM, step=step)
        optimizer.step()
        optimizer.zero_grad()
        if watch is not None:
            watch.maybe_check(model, batch, field_loss, step=step)
    return state_of(model, optimizer)


@pytest.mark.parametrize(
    ("make", "batches"),
    [(FNO, field_batches(3)), (QuantisedSide, _regression_batches(3))],
    ids=["complex-fno", "float8-and-integer-buffers"],
)
def test_a_model_of_any_dtype_is_checked_and_trains_as_without_the_watch(
    make: Callable[[], nn.Module], batches: list[Any]
) -> None:
    unwatched = _train(make, batches, None)
    watch = GradientWatch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watched = _train(make, batches, watch)
    assert_same_state(unwatched, watched)
    assert not watch.notes  # nothing the watch runs around the checks raised
    assert not [w for w in caught if issubclass(w.category, GradientCheckWarning)], [str(w.message) for w in caught]
    kinds = {(report.scope, report.fault is None and not report.probes) for report in watch.reports}
    assert ("recomputed", False) in kinds  # a recomputed check with probes
    assert ("applied", False) in kinds  # an applied check with probes
    assert ("applied", True) in kinds  # the clip coefficient's
    assert all(report.verdict != "fail" for report in watch.reports), [r.summary() for r in watch.reports]
    if make is FNO:  # the complex weight itself was probed
        probed = {probe.target for report in watch.reports for probe in report.probes}
        assert "spectral.weight" in probed, probed
