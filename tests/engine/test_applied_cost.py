"""What a healthy applied check costs (engine/applied/window_points.py, .../check.py): no loss evaluated at the
unperturbed point when the screens agree (the first screen's mean stands in for it), no dataflow watch in its
reference pass, the autocast rounding's own walk of each operation's arguments; a loss that is not a function of the
parameters alone is still not probed, and a planted fault still fails."""

from __future__ import annotations

import itertools

import torch
from applied_models import MLP, batch_for, cross_entropy, train_window
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from gradwatch.engine.applied import check_applied_gradient
from gradwatch.engine.applied.gradients import _floats, _mapped
from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.function.state import TrainingState
from gradwatch.engine.results.notes import NoteCode


def test_a_healthy_float32_check_evaluates_the_loss_at_the_screens_points_only() -> None:
    torch.manual_seed(0)
    model = MLP()
    window = train_window(model, [batch_for(model, seed=1)])
    report = window.check(cross_entropy)
    assert report.verdict == "ok", str(report)
    assert [p.kind for p in report.probes] == ["descent", "tensors"]
    # the reference pass and two screens of two points: no centre
    assert report.n_forward == 1 + sum(p.evaluations or 0 for p in report.probes) == 5


def test_a_loss_that_is_not_a_function_of_the_parameters_is_still_not_probed() -> None:
    torch.manual_seed(0)
    model = MLP()
    batch = batch_for(model, seed=1)
    calls = itertools.count()

    def noisy(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:  # another loss at every call
        return cross_entropy(model, batch) * (1 + 0.1 * next(calls))

    noisy(model, batch).backward()
    report = check_applied_gradient(model, [batch], noisy)
    assert report.verdict == "inconclusive", str(report)
    assert report.noted(NoteCode.APPLIED_NOT_REPRODUCIBLE), report.notes


def test_a_planted_fault_still_fails_the_cheaper_check() -> None:
    torch.manual_seed(0)
    model = MLP()
    handle = model.fc2.weight.register_hook(lambda grad: grad * 1.02)
    try:
        report = train_window(model, [batch_for(model, seed=1)]).check(cross_entropy, culprit_search=False)
    finally:
        handle.remove()
    assert report.verdict == "fail", str(report)
    assert any(p.verdict == "fail" and p.target == "fc2.weight" for p in report.probes), str(report)


def test_a_reference_pass_without_vectorised_passes_to_follow_gives_the_same_loss_and_gradient() -> None:
    torch.manual_seed(0)
    model = MLP()
    batch = batch_for(model, seed=1)
    params = [(n, p) for n, p in model.named_parameters()]
    state = TrainingState.capture(model)
    try:
        evaluator = LossEvaluator(model, batch, cross_entropy, params, state)
        watched = evaluator.reference(with_inputs=False)
        plain = evaluator.reference(with_inputs=False, vectorising=False)
    finally:
        state.restore()
    assert watched.loss == plain.loss
    assert all(torch.equal(a, b) for a, b in zip(watched.param_grads, plain.param_grads, strict=True))
    assert evaluator.saved_elements == 0  # nothing counted: no vectorised pass needs it


def test_the_autocast_rounding_walks_an_operations_arguments_as_pytree_does() -> None:
    a, b = torch.ones(2), torch.ones(3, dtype=torch.float64)
    args = (a, [1, b, torch.ones(1, dtype=torch.int64)], {"out": b, "dtype": torch.float32}, None, 2.0)
    flat = [t for t in tree_flatten(args)[0] if isinstance(t, Tensor) and t.is_floating_point()]
    assert [id(t) for t in _floats(args)] == [id(t) for t in flat]
    assert len(flat) == 3
    doubled = _mapped(lambda t: t * 2, args)
    assert type(doubled[1]) is list
    assert doubled[4] == 2.0
    assert doubled[2]["dtype"] is torch.float32
    assert torch.equal(doubled[0], 2 * a)
    assert torch.equal(doubled[2]["out"], 2 * b)
