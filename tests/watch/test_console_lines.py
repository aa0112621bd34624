"""What a user must see on the console, once per run and in one line: a loss that is not finite (no gradient failure),
a model with no trainable parameter, an unknown option (with the nearest valid name), an applied check too weak to
resolve a 3% error (a bf16 path) or one that left trainable tensors unchecked. Small models, plain loops, no Trainer."""

from __future__ import annotations

import contextlib
import logging
import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from loop_models import classification_batches, cross_entropy
from torch import Tensor, nn

from gradwatch import GradientCheckWarning, GradientWatch, GradWatch, check_applied_gradient, check_gradients
from gradwatch.engine.results.notes import NoteCode
from gradwatch.engine.results.rendering import render_text
from gradwatch.watch.alerts import WEAK_FLOOR

Path = Callable[[], contextlib.AbstractContextManager[Any]] | None


def _bf16() -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _loop(
    watch: GradientWatch, model: nn.Module, loss_fn: Any, steps: int, path: Path = None, lr: float = 1e-3
) -> None:
    """A plain loop with the watch's three calls (``record``, ``before_optimizer_step``, ``maybe_check``); with
    ``lr=0`` every step is at the same point, on the same batch."""
    trainable = [p for p in model.parameters() if p.requires_grad] or [nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD(trainable, lr=lr)
    batches = classification_batches(steps) if lr else classification_batches(1) * steps
    for step, batch in enumerate(batches, start=1):
        watch.record(batch)
        with path() if path else contextlib.nullcontext():
            loss = loss_fn(model, batch)
        if loss.requires_grad:
            loss.backward()
        watch.before_optimizer_step(model, loss_fn, step=step, path=path)
        optimizer.step()
        optimizer.zero_grad()
        watch.maybe_check(model, batch, loss_fn, step=step)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _gradwatch_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, GradientCheckWarning)]


# a loss that is not finite


def _nan_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return cross_entropy(model, batch) * math.nan


def test_a_nan_loss_is_said_to_be_the_loss_not_a_wrong_gradient() -> None:
    report = check_gradients(_mlp(), classification_batches(1)[0], _nan_loss)
    assert report.verdict == "fail"  # a loss training cannot use, as before
    text = render_text(report)
    headline = text.splitlines()[0]
    assert "the loss is not finite (nan) at step 0" in headline
    assert "not a wrong gradient" in headline
    assert "gradient check failed" not in text
    assert "loss loss" not in text  # the loss probe reads as the loss's value
    assert "loss: nan at the checked point" in text


def test_a_nan_loss_in_a_series_of_checks_gives_one_console_line() -> None:
    watch = GradientWatch(every_n_steps=1, max_overhead=None, applied_every_n_steps=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _loop(watch, _mlp(), _nan_loss, steps=4)
    assert [r.verdict for r in watch.recomputed_reports] == ["fail"] * 4
    said = _gradwatch_warnings(caught)
    assert len(said) == 1, said  # once per run, not at the 1st, 2nd and 4th failing check
    assert "\n" not in said[0]
    assert said[0].startswith("gradwatch: the loss is not finite (nan) at step 1")


# a model with no trainable parameter


def test_a_model_without_trainable_parameters_is_said_so_by_check_gradients() -> None:
    model = _mlp().requires_grad_(False)
    with pytest.warns(UserWarning, match="has no trainable floating-point parameter") as caught:
        report = check_gradients(model, classification_batches(1)[0], cross_entropy)
    assert len([w for w in caught if "no trainable" in str(w.message)]) == 1
    assert report.noted(NoteCode.NO_TRAINABLE_PARAMETER)
    assert {p.kind for p in report.probes} == {"input"}  # what it did check


def test_a_model_without_trainable_parameters_gives_one_console_line_in_a_series() -> None:
    watch = GradientWatch(every_n_steps=1, max_overhead=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _loop(watch, _mlp().requires_grad_(False), cross_entropy, steps=3)
    said = [m for m in _gradwatch_warnings(caught) if "no trainable floating-point parameter" in m]
    assert len(said) == 1, _gradwatch_warnings(caught)
    assert watch.counts["skipped"] == 3


# an unknown option


@pytest.mark.parametrize(
    ("make", "where"),
    [
        (lambda **o: GradWatch(**o), "GradWatch()"),
        (lambda **o: GradientWatch(**o), "GradientWatch()"),
        (lambda **o: check_gradients(_mlp(), classification_batches(1)[0], cross_entropy, **o), "check_gradients()"),
    ],
    ids=["GradWatch", "GradientWatch", "check_gradients"],
)
def test_an_unknown_option_is_answered_with_the_nearest_valid_name(make: Callable[..., object], where: str) -> None:
    wanted = "every_n_steps" if where != "check_gradients()" else "tensor_probes"
    typo = {"every_n_steps": "evry_n_steps", "tensor_probes": "tensor_probe"}[wanted]
    said = rf"{re.escape(where)} got unknown option\(s\) `{typo}` \(did you mean `{wanted}`\?\)"
    with pytest.raises(TypeError, match=said):
        make(**{typo: 1})


def test_an_unknown_option_of_the_hugging_face_callback_is_answered_with_the_nearest_valid_name() -> None:
    from gradwatch.integrations.huggingface import GradWatchCallback

    with pytest.raises(TypeError, match=r"`evry_n_steps` \(did you mean `every_n_steps`\?\)"):
        GradWatchCallback(None, evry_n_steps=1)  # type: ignore[arg-type]


def test_an_unknown_option_of_the_applied_check_is_answered_with_the_nearest_valid_name() -> None:
    model = _mlp()
    with pytest.raises(TypeError, match=r"check_applied_gradient\(\) got unknown option\(s\) `sed` \(did you mean"):
        check_applied_gradient(model, [classification_batches(1)[0]], cross_entropy, {}, sed=1)


def test_an_option_far_from_every_name_is_listed_without_a_guess() -> None:
    with pytest.raises(TypeError, match=r"unknown option\(s\) `zzz`; its options are .*every_n_steps") as raised:
        GradientWatch(zzz=1)  # type: ignore[call-arg]
    assert "did you mean" not in str(raised.value)


# an applied check too weak to resolve a 3% error


class _SharpLogits(nn.Module):
    """Logits 50 times a small MLP's: a nearly saturated softmax, whose gradient under bf16 autocast is rounded by
    more than 1% of its norm (the noise floor of the path)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) * 50.0


def test_a_bf16_applied_check_that_cannot_resolve_a_3_percent_error_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = GradientWatch(every_n_steps=100, applied_every_n_steps=1, max_overhead=None)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        _loop(watch, _SharpLogits(), cross_entropy, steps=3, path=_bf16, lr=0.0)
    applied = watch.applied_reports
    assert [r.verdict for r in applied] == ["ok", "ok", "ok"]
    assert all(r.noise_floor > 0.01 for r in applied), [r.noise_floor for r in applied]
    said = [r.getMessage() for r in caplog.records if "passed, but weakly" in r.getMessage()]
    assert len(said) == 1, said
    assert "\n" not in said[0]
    assert f"{100 * applied[0].noise_floor:.1f}% of ‖g‖" in said[0]


def test_a_float32_applied_check_is_not_called_weak(caplog: pytest.LogCaptureFixture) -> None:
    watch = GradientWatch(every_n_steps=100, applied_every_n_steps=1, max_overhead=None)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        _loop(watch, _SharpLogits(), cross_entropy, steps=3, lr=0.0)
    assert [r.verdict for r in watch.applied_reports] == ["ok", "ok", "ok"]
    assert all(r.noise_floor < 1e-4 for r in watch.applied_reports)
    assert not [r for r in caplog.records if "weakly" in r.getMessage()]


def test_a_muon_update_checks_bfloat16_floor_does_not_call_a_float32_applied_check_weak(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Muon's reference runs its Newton-Schulz iteration in bfloat16, so the update check's floor is a few percent;
    that is the reference's rounding, not the training path's: the float32 applied check is not called weak."""
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    muon = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
    watch = GradientWatch(every_n_steps=100, applied_every_n_steps=1, max_overhead=None, first_check_step=None)
    generator = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        for step in range(1, 3):
            batch = (torch.randn(16, 6, generator=generator), torch.randn(16, 3, generator=generator))
            watch.record(batch, step=step)
            model.zero_grad()
            nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
            watch.before_optimizer_step(model, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), step=step)
            muon.step()
            watch.after_optimizer_step(muon, step=step)
    updates = [r for r in watch.reports if r.scope == "update"]
    assert updates
    assert all(r.verdict == "ok" for r in updates), [r.summary() for r in updates]
    assert max(r.noise_floor for r in updates) > WEAK_FLOOR  # the reference's own bfloat16 rounding
    assert [r.verdict for r in watch.applied_reports] == ["ok", "ok"]
    assert all(r.noise_floor < 1e-4 for r in watch.applied_reports)
    assert not [r for r in caplog.records if "weakly" in r.getMessage()]


class _Unused(nn.Module):
    """A classifier with a trainable parameter its forward never uses: no gradient, so no applied check of it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 3)
        self.spare = nn.Parameter(torch.ones(3))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


def test_an_applied_check_that_leaves_a_tensor_unchecked_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    watch = GradientWatch(every_n_steps=100, applied_every_n_steps=1, max_overhead=None)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        _loop(watch, _Unused(), cross_entropy, steps=3)
    assert all(r.noted(NoteCode.APPLIED_UNCHECKED) for r in watch.applied_reports)
    said = [r.getMessage() for r in caplog.records if "not checked" in r.getMessage()]
    assert said == ["gradwatch (step 1): the applied check left 1 trainable parameter(s) not checked (no gradient, "
                    "ignore=, or not the derivative by design)"]  # fmt: skip
