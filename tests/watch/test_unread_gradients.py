"""A gradient the watch cannot read is said once, with the remedy, not left as a silent ``inconclusive`` at every step:
``before_optimizer_step`` called where no checked parameter has a ``.grad`` (after ``zero_grad``; an engine that keeps
its gradients elsewhere), and the clip check of a gradient given as ``gradients=`` without the norm it was clipped
with. The DeepSpeed engine itself, handed to the watch, is read for its gradients: ``tests/integrations/
test_deepspeed.py``."""

from __future__ import annotations

import warnings

import torch
from loop_models import MLP, classification_batches, cross_entropy

from gradwatch import GradientCheckWarning, GradientWatch

STEPS = 3


def _said(caught: list[warnings.WarningMessage], words: str) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, GradientCheckWarning) and words in str(w.message)]


def test_an_applied_check_without_a_gradient_to_read_says_so_once_naming_the_remedy() -> None:
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = GradientWatch(every_n_steps=10**6, first_check_step=None, applied_every_n_steps=1, max_overhead=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, batch in enumerate(classification_batches(STEPS), start=1):
            watch.record(batch, model=model, step=step)
            cross_entropy(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()  # the loop's mistake: the gradient is gone before the call
            watch.before_optimizer_step(model, cross_entropy, step=step)
    assert [r.verdict for r in watch.applied_reports] == ["inconclusive"] * STEPS
    said = _said(caught, "reads no gradient")
    assert len(said) == 1, said
    assert "before_optimizer_step(engine" in said[0]
    assert "FullGradients(engine)" in said[0]
    assert "before zero_grad" in said[0]


def test_a_healthy_loop_hears_nothing_of_unread_gradients() -> None:
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = GradientWatch(every_n_steps=10**6, first_check_step=None, applied_every_n_steps=1, max_overhead=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, batch in enumerate(classification_batches(STEPS), start=1):
            watch.record(batch, model=model, step=step)
            cross_entropy(model, batch).backward()
            watch.before_optimizer_step(model, cross_entropy, step=step)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            watch.after_clipping(model, 0.5, step=step)
            optimizer.step()
            optimizer.zero_grad()
    assert [r.verdict for r in watch.applied_reports if r.probes] == ["ok"] * STEPS
    assert not _said(caught, "reads no gradient")
    assert not _said(caught, "cannot read the clipped gradient")


def test_a_clip_check_of_given_gradients_without_their_clip_norm_says_so_once() -> None:
    """Gradients an engine keeps elsewhere (``gradients=``) are clipped out of ``.grad``: without ``clipped_with`` the
    clip check has nothing to read."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = GradientWatch(every_n_steps=10**6, first_check_step=None, applied_every_n_steps=1, max_overhead=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, batch in enumerate(classification_batches(STEPS), start=1):
            watch.record(batch, model=model, step=step)
            cross_entropy(model, batch).backward()
            kept = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            watch.before_optimizer_step(model, cross_entropy, step=step, gradients=kept)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            assert watch.after_clipping(model, 0.5, step=step) is None
            optimizer.step()
            optimizer.zero_grad()
    assert [r.verdict for r in watch.applied_reports] == ["ok"] * STEPS
    said = _said(caught, "cannot read the clipped gradient")
    assert len(said) == 1, said
    assert "clipped_with" in said[0]
