"""The sandbox: what the user's loss changes in the module tree is put back, in place, and what cannot be is named."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from helpers import assert_bit_identical, classification_batch, cross_entropy_loss, snapshot
from torch import Tensor, nn

from gradwatch import check_gradients
from gradwatch.engine.function.sandbox import Sandbox
from gradwatch.engine.results.notes import NoteCode


class Stateful(nn.Module):
    """A classifier whose forward has every kind of side effect users write."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.outputs: list[Tensor] = []
        self.n_seen = 0
        self.total = torch.zeros(())  # changed in place
        self.cache: dict[str, Any] = {"nested": [1, 2]}
        self.names: set[str] = set()
        self.history: collections.deque[float] = collections.deque(maxlen=2)
        self.registry = {"counter": nn.Module()}  # a module kept in a plain dict
        self.registry["counter"].count = 0  # type: ignore[assignment]

    def forward(self, x: Tensor) -> Tensor:
        logits = self.fc(x)
        self.outputs.append(logits.detach().sum())
        self.n_seen += len(x)
        self.total += 1
        self.cache["last"] = logits.detach()
        self.cache["nested"].append(3)
        self.names.add("seen")
        self.history.append(1.0)
        self.registry["counter"].count += 1  # type: ignore[operator]
        self.added_later = True
        return logits


def _state(model: Stateful) -> dict[str, Any]:
    return {
        "outputs": list(model.outputs),
        "outputs_id": id(model.outputs),
        "n_seen": model.n_seen,
        "total": model.total.clone(),
        "total_id": id(model.total),
        "cache": dict(model.cache),
        "nested": list(model.cache["nested"]),
        "names": set(model.names),
        "history": list(model.history),
        "count": model.registry["counter"].count,
        "added_later": hasattr(model, "added_later"),
    }


def _assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        if isinstance(value, Tensor):
            assert torch.equal(value, after[key]), key
        elif key == "cache":
            assert value.keys() == after[key].keys(), key
            assert all(value[k] is after[key][k] for k in value), key
        else:
            assert value == after[key], key


def _sandbox(model: nn.Module) -> Sandbox:
    return Sandbox(model, exclude={id(t) for t in (*model.parameters(), *model.buffers())})


def test_everything_the_forward_changed_is_put_back_in_place() -> None:
    model = Stateful()
    model(torch.randn(2, 16))  # some state to start from
    before = _state(model)
    sandbox = _sandbox(model)
    model(torch.randn(3, 16))
    sandbox.restore()
    _assert_same(before, _state(model))


def test_settle_names_the_changes_and_later_evaluations_are_restored_too() -> None:
    model = Stateful()
    before = _state(model)
    sandbox = _sandbox(model)
    model(torch.randn(3, 16))
    changed = sandbox.settle()
    assert {"outputs", "n_seen", "total", "cache", "cache['nested']", "names", "history", "added_later"} <= set(changed)
    assert "registry['counter'].count" in changed
    _assert_same(before, _state(model))
    for _ in range(3):
        model(torch.randn(3, 16))
        sandbox.restore_watched()
        _assert_same(before, _state(model))
    assert sandbox.unrestorable() == []


def test_parameters_and_buffers_are_left_to_the_training_state() -> None:
    model = nn.BatchNorm1d(4)
    sandbox = _sandbox(model)
    with torch.no_grad():
        model.weight.add_(1.0)
    model(torch.randn(8, 4))  # running statistics change
    assert sandbox.settle() == []
    assert torch.equal(model.weight, torch.full((4,), 2.0))  # not the sandbox's to restore


def test_a_tensor_in_a_list_changed_in_place_is_named_not_restored() -> None:
    model = nn.Module()
    model.buffer_list = [torch.zeros(3)]  # type: ignore[assignment]
    sandbox = _sandbox(model)
    model.buffer_list[0].add_(1.0)  # type: ignore[index]
    sandbox.restore()
    assert sandbox.unrestorable() == ["buffer_list[0]"]
    (note,) = sandbox.notes(sandbox.unrestorable())
    assert note.code == NoteCode.STATE_UNRESTORED
    assert "buffer_list[0]" in note


class _FailingClear(dict):
    """A dict whose first ``clear()`` raises: a restore that fails half-way."""

    failures = 1

    def clear(self) -> None:
        if _FailingClear.failures:
            _FailingClear.failures -= 1
            raise RuntimeError("clear failed")
        super().clear()


def test_a_restore_that_fails_restores_the_rest_and_raises() -> None:
    model = Stateful()
    model.fragile = _FailingClear(a=1)  # type: ignore[assignment]
    before = _state(model)
    sandbox = _sandbox(model)
    model(torch.randn(3, 16))
    model.fragile["b"] = 2  # type: ignore[index]
    _FailingClear.failures = 1
    with pytest.raises(RuntimeError, match="could not restore fragile: clear failed"):
        sandbox.restore()
    _assert_same(before, _state(model))  # everything else was put back
    sandbox.restore()
    assert dict(model.fragile) == {"a": 1}  # type: ignore[call-overload]


# ---- in a check --------------------------------------------------------------------------------------------------


def _stateful_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return cross_entropy_loss(model, batch)


def test_a_check_leaves_the_user_state_as_it_found_it_and_says_what_the_loss_changes() -> None:
    torch.manual_seed(0)
    model = Stateful()
    batch = classification_batch()
    model(batch[0])
    before = _state(model)
    report = check_gradients(model, batch, _stateful_loss)
    _assert_same(before, _state(model))
    assert report.verdict == "ok", str(report)
    assert {"outputs", "n_seen"} <= set(report.side_effects)
    assert report.unrestored == ()
    assert report.noted(NoteCode.STATE_RESTORED), report.notes


class Aggregating(nn.Module):
    """Appends each loss to a list, as the Lightning epoch-aggregation pattern does: vectorisable."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)).double()
        self.outputs: list[Tensor] = []


def _aggregating_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    loss = cross_entropy_loss(model.net, batch)
    model.outputs.append(loss.detach())  # type: ignore[union-attr, operator]
    return loss


def test_vectorised_passes_leave_no_batched_tensor_behind() -> None:
    torch.manual_seed(0)
    model = Aggregating()
    inputs, labels = classification_batch()
    batch = (inputs.double(), labels)
    _aggregating_loss(model, batch)
    kept = list(model.outputs)
    report = check_gradients(model, batch, _aggregating_loss)
    assert report.vectorized is True, report.notes
    assert model.outputs == kept
    torch.stack(model.outputs)  # an escaped batched tensor would make this raise


class _FailingStatefulLoss:
    """Changes the model's state at every call, and raises from the ``fail_at``-th call on."""

    def __init__(self, fail_at: int) -> None:
        self.calls = 0
        self.fail_at = fail_at

    def __call__(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        self.calls += 1
        loss = cross_entropy_loss(model, batch)
        if self.calls >= self.fail_at:
            raise RuntimeError("boom")
        return loss


@pytest.mark.parametrize("fail_at", [1, 2, 6])
def test_a_check_that_raises_leaves_parameters_state_and_user_state_as_they_were(fail_at: int) -> None:
    torch.manual_seed(0)
    model = Stateful()
    batch = classification_batch()
    cross_entropy_loss(model, batch).backward()
    before, user = snapshot(model), _state(model)
    with pytest.raises(RuntimeError, match="boom"):
        check_gradients(model, batch, _FailingStatefulLoss(fail_at), vectorize=False)
    assert_bit_identical(before, snapshot(model))
    _assert_same(user, _state(model))


def test_a_restore_that_fails_inside_a_check_still_restores_the_training_state() -> None:
    torch.manual_seed(0)
    model = Stateful()
    model.fragile = _FailingClear(a=1)  # type: ignore[assignment]
    batch = classification_batch()
    cross_entropy_loss(model, batch).backward()
    before, user = snapshot(model), _state(model)

    def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        model.fragile["b"] = 2  # type: ignore[index]
        return cross_entropy_loss(model, batch)

    _FailingClear.failures = 1
    with pytest.raises(RuntimeError, match="clear failed"):
        check_gradients(model, batch, loss, probe_batch_size=None)  # no smaller slice to retry on
    assert_bit_identical(before, snapshot(model))
    _assert_same(user, _state(model))
    assert dict(model.fragile) == {"a": 1}  # type: ignore[call-overload]
