"""Vectorised evaluation: what point-by-point evaluation measures, in fewer passes; point by point where it cannot be
exact."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    DropoutBatchNormNet,
    SeedModel,
    assert_bit_identical,
    classification_batch,
    cross_entropy_loss,
    seed_batch,
    seed_loss,
    snapshot,
)
from torch import Tensor, nn

from gradwatch import CheckReport, check_gradients
from gradwatch.engine.measuring import points as points_module
from gradwatch.engine.measuring import vectorized as vectorized_module
from gradwatch.engine.results.notes import NoteCode


def _check(model: nn.Module, vectorize: bool, **kwargs: object) -> CheckReport:
    # four samples: BatchNorm in training mode refuses one
    return check_gradients(
        model, classification_batch(), cross_entropy_loss, step=3, probe_batch_size=4, vectorize=vectorize, **kwargs
    )


def _same_measurements(first: CheckReport, second: CheckReport) -> None:
    assert [(p.kind, p.target, p.index, p.verdict) for p in first.probes] == [
        (p.kind, p.target, p.index, p.verdict) for p in second.probes
    ]
    # vmap's batched kernels round differently from the unbatched ones (~1e-16 of the loss), which a difference over a
    # float64 step of 6e-6 turns into ~1e-9 of the derivative: the measurements agree within the noise they estimate
    for a, b in zip(first.probes, second.probes, strict=True):
        assert abs(a.numeric - b.numeric) <= max(a.noise, b.noise), (a.describe(), b.describe())


def test_vectorised_passes_measure_what_point_by_point_evaluation_measures() -> None:
    # dropout (the same masks for every point) and BatchNorm in training mode (its running statistics untouched)
    torch.manual_seed(0)
    model = DropoutBatchNormNet()
    cross_entropy_loss(model, classification_batch()).backward()
    before = snapshot(model)
    vectorised = _check(model, vectorize=True)
    assert_bit_identical(before, snapshot(model))
    one_by_one = _check(model, vectorize=False)
    assert vectorised.vectorized is True
    assert one_by_one.vectorized is None
    assert vectorised.verdict == one_by_one.verdict == "ok", str(vectorised)
    assert vectorised.n_passes < one_by_one.n_passes
    assert vectorised.n_forward == one_by_one.n_forward + 1  # the centre, which the first pass reproduces
    _same_measurements(vectorised, one_by_one)


def test_one_percent_error_is_caught_and_located_in_a_vectorised_check() -> None:
    torch.manual_seed(0)
    model = DropoutBatchNormNet()
    model.net[4].weight.register_hook(lambda grad: grad * 1.01)  # a hook that corrupts the gradient training uses
    report = _check(model, vectorize=True)
    assert report.vectorized is True
    assert report.verdict == "fail", str(report)
    assert "net.4.weight" in {p.target for p in report.failures if p.kind == "tensor"}


def test_memory_budget_splits_the_points_over_more_passes_or_leaves_them_one_by_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = DropoutBatchNormNet()
    whole = _check(model, vectorize=True)
    monkeypatch.setattr(points_module, "memory_budget", lambda params: 100_000)  # bytes: a few points per pass
    split = _check(model, vectorize=True)
    assert split.vectorized is True
    assert split.n_forward == whole.n_forward
    assert split.n_passes > whole.n_passes
    _same_measurements(split, whole)
    monkeypatch.setattr(points_module, "memory_budget", lambda params: 10_000)  # too little for a pass of 4 points
    none = _check(model, vectorize=True)
    assert none.vectorized is None
    assert none.n_passes == none.n_forward
    _same_measurements(none, whole)


def test_custom_function_without_a_vmap_rule_is_evaluated_point_by_point() -> None:
    # SeedModel's autograd.Function has no setup_context: vmap refuses it, which the reference's graph shows
    report = check_gradients(SeedModel(), seed_batch(), seed_loss)
    assert report.vectorized is None  # no vectorised pass tried only to fail
    assert report.n_passes == report.n_forward
    assert any("has no vmap rule" in note for note in report.noted(NoteCode.NOT_VECTORISABLE)), report.notes
    assert report.verdict == "ok", str(report)
    buggy = check_gradients(SeedModel(weight_scale=1.01), seed_batch(), seed_loss)
    assert buggy.verdict == "fail"


class _Tanh(torch.autograd.Function):
    """tanh written by hand in the style functorch accepts (``setup_context``); ``generate_vmap_rule`` per subclass."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx: object, inputs: tuple[Tensor], output: Tensor) -> None:
        ctx.save_for_backward(output)  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tensor:
        (output,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad * (1 - output * output)


class _TanhWithoutRule(_Tanh):
    generate_vmap_rule = False


class _HandTanhNet(nn.Module):
    def __init__(self, function: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.function, self.fc1, self.fc2 = function, nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.function.apply(self.fc1(x)))


@pytest.mark.parametrize(("function", "vectorized"), [(_Tanh, True), (_TanhWithoutRule, None)], ids=["rule", "none"])
def test_a_custom_function_is_vectorised_exactly_when_vmap_has_a_rule_for_it(
    function: type[torch.autograd.Function], vectorized: bool | None
) -> None:
    torch.manual_seed(0)
    batch = (torch.randn(8, 8), torch.randint(0, 3, (8,)))
    report = check_gradients(_HandTanhNet(function), batch, cross_entropy_loss, probe_batch_size=4)
    assert report.verdict == "ok", str(report)
    assert report.vectorized is vectorized
    refused = [note for note in report.noted(NoteCode.NOT_VECTORISABLE) if "_TanhWithoutRule has no vmap rule" in note]
    assert bool(refused) is (vectorized is None), report.notes


def test_loss_that_computes_something_else_when_vectorised_is_evaluated_point_by_point() -> None:
    def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        value = cross_entropy_loss(model, batch)
        if torch._C._functorch.is_batchedtensor(value):  # simulates a function vmap changes without an error
            value = value * (1 + 1e-9)
        return value

    torch.manual_seed(0)
    model = DropoutBatchNormNet()
    report = check_gradients(model, classification_batch(), loss, probe_batch_size=4)
    assert report.vectorized is False
    assert report.noted(NoteCode.VECTORISED_MISMATCH), report.notes
    assert report.verdict == "ok", str(report)


def test_native_float32_probes_are_not_vectorised() -> None:
    torch.manual_seed(0)
    report = _check(DropoutBatchNormNet(), vectorize=True, precision="native")
    assert report.vectorized is None
    assert report.n_passes == report.n_forward


def test_float64_model_is_vectorised_in_its_own_precision() -> None:
    torch.manual_seed(0)
    model = DropoutBatchNormNet().double()
    batch = tuple(t.double() if t.is_floating_point() else t for t in classification_batch())
    report = check_gradients(model, batch, cross_entropy_loss, probe_batch_size=4)
    assert report.vectorized is True
    assert report.verdict == "ok", str(report)


def test_model_with_forward_hooks_is_evaluated_point_by_point() -> None:
    # a hook that keeps activations would keep the batched tensors of a vectorised pass
    torch.manual_seed(0)
    model = DropoutBatchNormNet()
    kept: list[Tensor] = []
    handle = model.net[2].register_forward_hook(lambda module, args, output: kept.append(output))
    report = _check(model, vectorize=True)
    handle.remove()
    assert report.vectorized is None
    (note,) = report.noted(NoteCode.HOOKS_UNVECTORISED)
    assert "net.2" in note, report.notes
    assert report.n_passes == report.n_forward
    assert all(output.shape == (4, 32) for output in kept)  # one point's activations each time


def test_stacked_rows_hold_what_moving_each_point_on_its_own_writes() -> None:
    from gradwatch.engine.measuring.directions import CoordinateDirection, VectorDirection
    from gradwatch.engine.measuring.vectorized import _stacks

    torch.manual_seed(0)
    weight, bias = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    grads = [torch.randn(4, 3, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    both = VectorDirection([weight, bias], grads, grads, 0.5)
    alone = VectorDirection([bias], [grads[1]], [grads[1]], 2.0)
    coordinate = CoordinateDirection(weight, (2, 1), gradient=1.0)
    moves = [(both, 0.1), (both, -0.1), (coordinate, 0.25), (alone, 0.3), (both, 0.2), (coordinate, -0.25)]
    stacks, displacements = _stacks(moves, first_slot=1)
    assert stacks[id(weight)].shape == (7, 4, 3)
    assert stacks[id(bias)].shape == (7, 4)
    for tensor in (weight, bias):
        assert torch.equal(stacks[id(tensor)][0], tensor)  # the unperturbed point
    for slot, (direction, offset) in enumerate(moves, start=1):
        with direction.displaced(offset) as displacement:
            assert displacement == displacements[slot - 1]
            for tensor in (weight, bias):
                assert torch.equal(stacks[id(tensor)][slot], tensor), (slot, direction)


def test_one_tensor_points_go_in_two_passes_split_between_tensors() -> None:
    from types import SimpleNamespace

    from gradwatch.engine.measuring.directions import CoordinateDirection
    from gradwatch.engine.measuring.vectorized import MIN_POINTS, VectorizedLoss

    tensors = [torch.zeros(3) for _ in range(4)]
    passes = SimpleNamespace(_positions={id(t): position for position, t in enumerate(tensors)})

    def halves(points_per_tensor: list[int]) -> list[list[int]]:
        moves = [
            (CoordinateDirection(tensor, (0,), 0.0), 1.0)
            for tensor, count in zip(tensors, points_per_tensor, strict=False)
            for _ in range(count)
        ]
        return VectorizedLoss._halves(passes, list(range(len(moves))), moves)  # type: ignore[arg-type]

    assert halves([4, 2, 6, 4]) == [list(range(6)), list(range(6, 16))]  # the tensor boundary nearest the middle
    assert halves([2, 10, 4]) == [list(range(12)), list(range(12, 16))]  # each pass keeps MIN_POINTS
    assert halves([2, 10]) == [list(range(12))]  # no boundary leaves MIN_POINTS on both sides
    assert halves([MIN_POINTS, MIN_POINTS]) == [list(range(MIN_POINTS)), list(range(MIN_POINTS, 2 * MIN_POINTS))]


def test_screens_of_a_model_with_large_activations_take_two_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = DropoutBatchNormNet()
    small = _check(model, vectorize=True)  # its activations are below SPLIT_ACTIVATIONS: one pass for the screens
    monkeypatch.setattr(vectorized_module, "SPLIT_ACTIVATIONS", 0)
    split = _check(model, vectorize=True)
    assert split.vectorized is True
    assert split.n_forward == small.n_forward
    assert split.n_passes == small.n_passes + 1
    _same_measurements(split, small)
