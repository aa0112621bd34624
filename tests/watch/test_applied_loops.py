"""Both kinds of check through ``GradientWatch`` alone, in the three loops of docs/loops.md: a plain PyTorch loop, a
Lightning Fabric loop and an Accelerate loop (``accelerator.accumulate``), each with gradient accumulation 2 and the
watch's three calls (``record`` before each micro-batch's forward, ``before_optimizer_step`` before the step,
``maybe_check`` after it). Healthy runs train bit for bit as without the watch; a backward wrong only under bf16
autocast fails the first applied check with ``fault == "precision"``; gradients not zeroed between windows fail with
``"accumulation"``; a wrong formula is caught by both kinds, the recomputed check naming its module."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from applied_models import MLP
from lightning.fabric import Fabric
from loop_models import assert_same_state, classification_batches, cross_entropy, plant_bug, state_of

from gradwatch import GradientCheckWarning, GradientWatch
from gradwatch.engine.results.notes import NoteCode
from gradwatch.watch.hooks import TrainingPath

STEPS, ACCUMULATE = 3, 2


def _model(fault: float = 1.0, bug: bool = False) -> MLP:
    torch.manual_seed(0)
    model = MLP(autocast_fault=fault)
    if bug:
        plant_bug(model.fc2)
    return model


def _bf16() -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def plain_loop(
    watch: GradientWatch | None, model: MLP, *, bf16: bool = False, zero_grad: bool = True, tell_path: bool = True
) -> Any:
    """The recipe: record each micro-batch, the applied check before the step, the recomputed one after it
    (``tell_path=False``: the loop omits ``path=``, as many do)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    path = _bf16 if bf16 else None
    batches = iter(classification_batches(STEPS * ACCUMULATE))
    for step in range(1, STEPS + 1):
        for _ in range(ACCUMULATE):
            batch = next(batches)
            if watch is not None:
                watch.record(batch)
            with path() if path else contextlib.nullcontext():
                loss = cross_entropy(model, batch)
            (loss / ACCUMULATE).backward()
        if watch is not None:
            watch.before_optimizer_step(model, cross_entropy, step=step, path=path if tell_path else None)
        optimizer.step()
        if zero_grad:
            optimizer.zero_grad()
        if watch is not None:
            watch.maybe_check(model, batch, cross_entropy, step=step)
    return state_of(model, optimizer)


def fabric_loop(
    watch: GradientWatch | None, model: MLP, *, bf16: bool = False, zero_grad: bool = True, tell_path: bool = True
) -> Any:
    """Fabric runs the wrapped module's forward in its precision's autocast: that is the path; the watch gets the
    module itself (``model.module``)."""
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed" if bf16 else "32-true")
    module = model
    wrapped, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    batches = iter(classification_batches(STEPS * ACCUMULATE))
    for step in range(1, STEPS + 1):
        for _ in range(ACCUMULATE):
            batch = fabric.to_device(next(batches))
            if watch is not None:
                watch.record(batch)
            fabric.backward(cross_entropy(wrapped, batch) / ACCUMULATE)
        if watch is not None:
            watch.before_optimizer_step(module, cross_entropy, step=step, path=fabric.autocast if tell_path else None)
        optimizer.step()
        if zero_grad:
            optimizer.zero_grad()
        if watch is not None:
            watch.maybe_check(module, batch, cross_entropy, step=step)
    return state_of(module, optimizer.optimizer)


def accelerate_loop(
    watch: GradientWatch | None, model: MLP, *, bf16: bool = False, zero_grad: bool = True, tell_path: bool = True
) -> Any:
    """Accelerate: ``record`` inside ``accelerator.accumulate`` before the forward, both checks on the sync step
    (``accelerator.sync_gradients``), around ``optimizer.step()``; ``accelerator.backward`` divides each loss by the
    accumulation steps (``combine="mean"``)."""
    accelerate = pytest.importorskip("accelerate")
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)  # each run its own precision
    accelerator = accelerate.Accelerator(
        cpu=True, gradient_accumulation_steps=ACCUMULATE, mixed_precision="bf16" if bf16 else "no"
    )
    wrapped, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    module = accelerator.unwrap_model(wrapped)
    step = 0
    for batch in classification_batches(STEPS * ACCUMULATE):
        with accelerator.accumulate(wrapped):
            if watch is not None:
                watch.record(batch)
            accelerator.backward(cross_entropy(wrapped, batch))
            if accelerator.sync_gradients and watch is not None:
                path = accelerator.autocast if tell_path else None
                watch.before_optimizer_step(module, cross_entropy, step=step + 1, path=path)
            optimizer.step()
            if zero_grad:
                optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            if watch is not None:
                watch.maybe_check(module, batch, cross_entropy, step=step)
    accelerator.end_training()
    return state_of(module, optimizer.optimizer)


LOOPS: dict[str, Callable[..., Any]] = {"plain": plain_loop, "fabric": fabric_loop, "accelerate": accelerate_loop}


def _watch(**options: Any) -> GradientWatch:
    return GradientWatch(every_n_steps=2, applied_every_n_steps=1, max_overhead=None, **options)


@pytest.mark.parametrize("loop", LOOPS, ids=list(LOOPS))
def test_healthy_runs_are_checked_by_both_kinds_and_train_as_without(loop: str) -> None:
    watch = _watch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        watched = LOOPS[loop](watch, _model())
    kinds = [(r.scope, r.step, r.verdict) for r in watch.reports]
    assert kinds == [
        ("applied", 1, "ok"), ("update", 1, "ok"), ("recomputed", 1, "ok"), ("applied", 2, "ok"), ("update", 2, "ok"),
        ("recomputed", 2, "ok"), ("applied", 3, "ok"), ("update", 3, "ok"),
    ]  # fmt: skip
    assert watch.counts["applied_checks"] == 3
    assert watch.counts["update_checks"] == 3  # the optimizer found by its step hooks: the loops name none
    assert_same_state(LOOPS[loop](None, _model()), watched)


@pytest.mark.parametrize("loop", LOOPS, ids=list(LOOPS))
def test_a_backward_wrong_only_under_bf16_autocast_is_a_precision_fault(loop: str) -> None:
    watch = GradientWatch(every_n_steps=100, applied_every_n_steps=100, max_overhead=None, on_fail=lambda r: None)
    LOOPS[loop](watch, _model(fault=1.5), bf16=True)
    first = watch.applied_reports[0]
    assert (first.step, first.verdict, first.fault) == (1, "fail", "precision"), str(first)
    assert all(r.verdict == "ok" for r in watch.reports if r.scope == "recomputed")  # eager float32 is right


@pytest.mark.parametrize("loop", LOOPS, ids=list(LOOPS))
@pytest.mark.parametrize("fault", [1.0, 1.5], ids=["healthy", "autocast-only-fault"])
def test_a_bf16_loop_that_omits_path_is_judged_on_its_inferred_bf16_path(loop: str, fault: float) -> None:
    """No false alarm on a correct bf16 loop that does not pass ``path=`` (the plain loop's autocast is inferred by a
    replay, Fabric's and Accelerate's, which wrap the forward, from the region the forward enters); a backward wrong
    only under autocast is still a precision fault there."""
    watch = _watch(on_fail=lambda report: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error" if fault == 1.0 else "ignore", GradientCheckWarning)
        LOOPS[loop](watch, _model(fault=fault), bf16=True, tell_path=False)
    expected = ("ok", None) if fault == 1.0 else ("fail", "precision")
    assert [(r.verdict, r.fault) for r in watch.applied_reports] == [expected] * STEPS
    assert all(r.noted(NoteCode.APPLIED_PATH_INFERRED) for r in watch.applied_reports)


def test_gradients_not_zeroed_between_windows_are_an_accumulation_fault() -> None:
    watch = _watch(on_fail=lambda report: None)
    plain_loop(watch, _model(), zero_grad=False)
    verdicts = [(r.step, r.verdict, r.fault) for r in watch.applied_reports]
    assert verdicts[0] == (1, "ok", None)  # nothing left over before the first window
    assert verdicts[1] == (2, "fail", "accumulation")


def test_a_wrong_formula_fails_both_kinds_and_the_recomputed_check_names_its_module() -> None:
    watch = GradientWatch(every_n_steps=100, applied_every_n_steps=100, max_overhead=None, on_fail=lambda r: None)
    plain_loop(watch, _model(bug=True))
    applied, recomputed = watch.applied_reports[0], next(r for r in watch.reports if r.scope == "recomputed")
    assert (applied.verdict, applied.fault) == ("fail", "formula")
    assert recomputed.verdict == "fail"
    assert recomputed.culprits[0] == "fc2"
    assert watch.counts["applied_failed"] == watch.counts["applied_checks"] == 1


def test_a_window_is_recorded_only_when_due() -> None:
    watch = GradientWatch(every_n_steps=100, applied_every_n_steps=2, first_check_step=None, max_overhead=None)
    model, batch = _model(), classification_batches(1)[0]
    recorded = []
    for step in range(1, 5):
        watch.record(batch, model=model)
        recorded.append(watch.recording)
        cross_entropy(model, batch).backward()
        watch.before_optimizer_step(model, cross_entropy, step=step)
        model.zero_grad()
        watch.maybe_check(model, batch, cross_entropy, step=step)
    assert recorded == [False, True, False, True]
    assert [r.step for r in watch.applied_reports] == [2, 4]
    state = watch.state_dict()
    resumed = GradientWatch(every_n_steps=100, applied_every_n_steps=2, first_check_step=None, max_overhead=None)
    resumed.load_state_dict(state)
    assert resumed.counts["applied_checks"] == 2


def test_the_applied_options_are_validated() -> None:
    with pytest.raises(ValueError, match="`applied_every_n_steps` must be None or an integer >= 1; got 0"):
        GradientWatch(applied_every_n_steps=0)
    with pytest.raises(ValueError, match="`step` must be an integer >= 1; got 0"):
        GradientWatch().before_optimizer_step(_model(), cross_entropy, step=0)


def _clipped_loop(watch: GradientWatch, clip: Callable[[list[torch.Tensor], float], None], max_norm: float) -> None:
    """A plain loop that clips between the applied check and the step, and tells the watch after clipping."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step, batch in enumerate(classification_batches(2), start=1):
        watch.record(batch)
        cross_entropy(model, batch).backward()
        watch.before_optimizer_step(model, cross_entropy, step=step)
        clip([p for p in model.parameters() if p.grad is not None], max_norm)
        watch.after_clipping(model, max_norm, step=step)
        optimizer.step()
        optimizer.zero_grad()


def _clip_twice_as_hard(grads: list[torch.Tensor], max_norm: float) -> None:
    """A clip norm computed as if the gradient's norm were twice what it is (over-counted across a mesh, say)."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in grads]))
    for p in grads:
        p.grad.mul_(min(1.0, max_norm / (2 * float(norm) + 1e-6)))


def test_correct_clipping_is_checked_clean_and_a_wrong_clip_coefficient_fails_as_clipping() -> None:
    watch = _watch()
    _clipped_loop(watch, lambda grads, max_norm: torch.nn.utils.clip_grad_norm_(grads, max_norm), 0.05)
    clipping = [r for r in watch.applied_reports if r.probes == []]
    assert [(r.step, r.verdict) for r in clipping] == [(1, "ok"), (2, "ok")]
    wrong = _watch(on_fail=lambda report: None)
    _clipped_loop(wrong, _clip_twice_as_hard, 0.05)
    failed = [r for r in wrong.applied_reports if r.fault == "clipping"]
    assert [r.step for r in failed] == [1, 2]
    assert "clipped by" in failed[0].fault_message  # the coefficient applied ...
    assert "give" in failed[0].fault_message  # ... and the one the true norm gives


def _summed_window(watch: GradientWatch, **how: Any) -> None:
    """One step of a window of two micro-batches whose losses are summed (not divided by their count)."""
    model = _model()
    for batch in classification_batches(2):
        watch.record(batch, model=model, step=1)
        cross_entropy(model, batch).backward()
    watch.before_optimizer_step(model, cross_entropy, step=1, **how)


def test_the_training_path_object_is_the_combine_path_join_and_normalisation_given_one_by_one() -> None:
    """``training=TrainingPath(combine="sum")`` is ``combine="sum"``: a summed window is right so and wrong as a mean;
    giving both ways at once is refused."""
    verdicts = []
    for how in ({"training": TrainingPath(combine="sum")}, {"combine": "sum"}, {"training": TrainingPath()}):
        watch = _watch(on_fail=lambda report: None)
        _summed_window(watch, **how)
        verdicts.append(watch.applied_reports[0].verdict)
    assert verdicts == ["ok", "ok", "fail"]
    with pytest.raises(ValueError, match="give `training` or `combine`"):
        _summed_window(_watch(), training=TrainingPath(combine="sum"), combine="sum")
