"""What a check's probes hold in memory: one copy of what they move at a time, and no float64 copy for a float64
substitute (restored from its parameter instead): ``benchmarks/memory.py`` measures the peaks on GPT-like models."""

from __future__ import annotations

import math
import weakref
from types import SimpleNamespace

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradwatch.engine.applied.gradients import float64_gradient, float64_reduced
from gradwatch.engine.applied.measured import difference_dot
from gradwatch.engine.applied.measurement import _sharing
from gradwatch.engine.applied.verdict import distances
from gradwatch.engine.function.copies import FlatCopies, SavedParameter, kept_copy, same_bits
from gradwatch.engine.function.guard import ModelGuard
from gradwatch.engine.function.precision import exact_source, float64_storage
from gradwatch.engine.function.state import TrainingState
from gradwatch.engine.measuring.directions import KEPT_COPY_ELEMENTS, VectorDirection
from gradwatch.engine.numerics.norms import CHUNK_ELEMENTS, dot, norms


def test_a_direction_frees_its_copy_of_the_tensors_when_its_move_ends() -> None:
    tensor = torch.randn(KEPT_COPY_ELEMENTS + 1, dtype=torch.float32)  # large: small ones keep their copy
    before = tensor.clone()
    grad = torch.randn_like(tensor)
    direction = VectorDirection([tensor], [grad], [grad], 1 / float(grad.norm()))
    with direction.moving() as move:
        move(0.1)
        assert not torch.equal(tensor, before)
        assert direction._origin is not None
    assert torch.equal(tensor, before)  # restored exactly
    assert direction._origin is None
    assert direction._components_cast is None


def test_a_float64_substitute_is_moved_in_float64_and_restored_from_its_parameter() -> None:
    model = nn.Linear(1024, 1025)  # a direction over more than KEPT_COPY_ELEMENTS
    weight = model.weight
    grad = torch.randn_like(weight)
    with float64_storage(model) as substitutes:
        substitute = substitutes[id(weight)]
        assert exact_source(substitute) is weight
        assert exact_source(weight) is None
        direction = VectorDirection([substitute], [grad], [grad], 1 / float(grad.double().norm()))
        with direction.moving() as move:
            shown = move(1e-6)
            assert direction._origin is not None
            assert direction._origin[0].data_ptr() == weight.data_ptr()
            moved = substitute.clone()
        # the move is computed in float64: origin + offset · v to float64's rounding, not float32's
        expected = weight.double() + 1e-6 * grad.double() / float(grad.double().norm())
        assert torch.allclose(moved, expected, rtol=0, atol=1e-15)
        assert abs(shown.along / 1e-6 - 1) < 1e-9
        assert torch.equal(substitute, weight.double())


class _Tied(nn.Module):
    """A language model whose head reads the embedding's weight outside the embedding (``.T``), with a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(32, 16)
        self.mix = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.mix(self.embedding(tokens)))) @ self.embedding.weight.T


def test_parameters_not_moved_are_read_in_float64_without_a_copy_of_them() -> None:
    torch.manual_seed(0)
    model = _Tied()
    tokens = torch.randint(0, 32, (2, 8))

    def loss() -> torch.Tensor:
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())

    with float64_storage(model) as every:
        whole = loss()
    weight = model.mix.weight
    with float64_storage(model, moved={id(weight)}) as moved:
        assert set(moved) == {id(weight)}
        assert model.mix.weight is moved[id(weight)]
        assert model.embedding.weight.dtype == torch.float32  # left in place, read in float64 where used
        moved[id(weight)].add_(1e-9)  # the moved one is the float64 substitute the model uses
        partial = loss()
        moved[id(weight)].sub_(1e-9)
        again = loss()
    assert len(every) == 5
    assert partial.dtype == torch.float64
    assert again.item() == whole.item()  # the same float64 function
    assert partial.item() != whole.item()


class _LargestOutput(TorchDispatchMode):
    """The most elements of any tensor an operation returns while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


def test_the_guard_compares_the_parameters_with_its_copy_without_a_temporary_of_the_model() -> None:
    model = nn.Sequential(nn.Linear(300, 300), nn.Linear(300, 300), nn.Linear(300, 10))
    saved = [SavedParameter(p, name, p.detach(), None, p._version, []) for name, p in model.named_parameters()]
    copies = FlatCopies(saved)
    with torch.no_grad():
        model[1].weight.data[3, 4] += 1.0  # behind autograd's back
    with _LargestOutput() as seen:
        differing = copies.differing()
    assert differing == {id(saved[2])}
    assert seen.largest <= max(p.numel() for p in model.parameters())  # no flat copy of the model made to compare


def test_a_balanced_direction_makes_its_weighted_gradients_when_used_with_the_same_bits() -> None:
    tensors = [torch.randn(1100, 1000), torch.randn(1100)]  # large: its components are made one at a time
    grads = [torch.randn_like(t) for t in tensors]
    weights = [0.37, 1.9]
    made = VectorDirection(tensors, [g * w for g, w in zip(grads, weights, strict=True)], grads)
    scaled = VectorDirection(tensors, grads, grads, scales=weights)
    assert scaled.analytic == made.analytic
    assert scaled._squared_norm() == made._squared_norm()
    assert all(c is g for c, g in zip(scaled._components, grads, strict=True))  # no weighted copy held
    model = nn.Linear(1000, 1100)
    parameters = [model.weight, model.bias]
    with float64_storage(model) as substitutes:
        moved = [substitutes[id(p)] for p in parameters]
        found = []
        for direction in (made, scaled):
            direction = VectorDirection(moved, direction._components, grads, scales=direction._scales)
            with direction.moving() as move:
                shown = move(1e-3)
                found.append(([m.clone() for m in moved], shown))
        (values_made, shown_made), (values_scaled, shown_scaled) = found
        assert shown_made == shown_scaled
        assert all(torch.equal(a, b) for a, b in zip(values_made, values_scaled, strict=True))


def test_a_chunked_dot_product_is_the_whole_one_bit_for_bit() -> None:
    torch.manual_seed(0)
    for shape in [(CHUNK_ELEMENTS + 7,), (1500, 1001), (3, 5)]:
        a, b = torch.randn(shape), torch.randn(shape)
        assert dot(a, b).item() == (a * b).sum(dtype=torch.float64).item()
        assert dot(a, b, b_scale=0.3).item() == (a * (b * 0.3)).sum(dtype=torch.float64).item()
        assert dot(a, a, a_scale=0.3, b_scale=0.3).item() == ((a * 0.3) * (a * 0.3)).sum(dtype=torch.float64).item()
        x = a + 1e-3 * b
        whole = x.to(torch.float64, copy=True).sub_(b.double()).mul_(a).sum(dtype=torch.float64)
        assert difference_dot(x, b, a) == float(whole)


def test_the_eager_gradient_is_the_applied_one_where_their_bits_agree() -> None:
    applied = [torch.randn(4, 3), torch.randn(3)]
    eager = [applied[0].clone(), applied[1] + 1e-3]
    setting = SimpleNamespace(session=SimpleNamespace(collective=None), group=None)
    shared = _sharing(eager, applied, setting)  # type: ignore[arg-type]
    assert shared[0] is applied[0]  # one copy of the gradient held, not two
    assert shared[1] is eager[1]


def test_a_distance_of_large_gradients_is_the_whole_difference_s_norm_bit_for_bit() -> None:
    torch.manual_seed(0)
    for shape in [(CHUNK_ELEMENTS + 5,), (1200, 1000), (7, 3)]:
        x = torch.randn(shape)
        y = x + 1e-3 * torch.randn(shape)
        whole = torch.linalg.vector_norm(x - y, dtype=torch.float64).item()
        assert distances([x, x.bfloat16()], [y, y.bfloat16()]) == [
            norms([x - y], exact=True)[0],
            norms([x.bfloat16().float() - y.bfloat16().float()], exact=True)[0],
        ]
        assert math.isclose(distances([x], [y])[0], whole, rel_tol=1e-12)


class _Odd(nn.Module):
    """Gradients autograd makes in odd ways: a weight used transposed, a parameter hook, one parameter unused."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.turned = nn.Parameter(torch.randn(5, 8))
        self.unused = nn.Parameter(torch.randn(3))
        self.last = nn.Linear(5, 2)
        self.last.weight.register_hook(lambda grad: grad * 3.0)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(torch.tanh(self.first(batch)) @ self.turned.T.contiguous()))


def test_the_float64_gradient_is_reduced_as_autograd_makes_it_with_the_same_bits() -> None:
    torch.manual_seed(0)
    model = _Odd()
    batch = torch.randn(4, 6)
    params = list(model.parameters())

    def loss_fn(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return (module(batch) ** 2).sum()

    state = TrainingState.capture(model)
    whole = float64_gradient(model, batch, loss_fn, params, state)
    alive: list[weakref.ref[torch.Tensor]] = []

    def reduce(i: int, grad: torch.Tensor) -> tuple[int, float, tuple[int, ...]]:
        held = sum(ref() is not None for ref in alive)
        alive.append(weakref.ref(grad))
        return held, float(grad.double().norm()), grad.stride()

    found = float64_reduced(model, batch, loss_fn, params, state, reduce)
    assert [norm for _, norm, _ in found] == [float(g.double().norm()) for g in whole]  # the same bits
    assert [stride for _, _, stride in found] == [g.stride() for g in whole]  # laid out as autograd made them
    turned, unused, hooked = (
        next(i for i, p in enumerate(params) if p is t) for t in (model.turned, model.unused, model.last.weight)
    )
    assert not whole[turned].is_contiguous()  # (the transposed weight's gradient is not)
    assert all(held == 0 for i, (held, _, _) in enumerate(found) if i != hooked)  # one float64 gradient at a time
    assert torch.equal(whole[unused], torch.zeros(3, dtype=torch.float64))


def test_a_direction_restores_a_parameter_from_the_guard_s_copy_of_it_with_the_same_bits() -> None:
    model = nn.Linear(1024, 1025)  # a direction over more than KEPT_COPY_ELEMENTS
    weight, bias = model.weight, model.bias
    before = weight.detach().clone()
    guard = ModelGuard(model)
    kept = next(p.copy for p in guard._parameters if p.tensor is weight)
    assert kept is not None
    grads = [torch.randn_like(weight), torch.randn_like(bias)]
    direction = VectorDirection([weight, bias], grads, grads, 0.1)
    with direction.moving() as move:
        move(0.1)
        assert direction._origin is not None
        assert direction._origin[0].data_ptr() == kept.data_ptr()  # no second copy of the weight
        assert not torch.equal(weight, before)
    assert same_bits(weight.detach(), before)  # restored exactly
    with torch.no_grad():
        weight[0, 0] += 1.0  # no longer the guard's copy: a copy of its own
    changed = weight.detach().clone()
    with direction.moving() as move:
        move(0.1)
        assert direction._origin is not None
        assert direction._origin[0].data_ptr() != kept.data_ptr()
    assert same_bits(weight.detach(), changed)
    del guard, kept
    assert kept_copy(weight) is None  # the guard gone, nothing of it held


def test_the_float64_gradient_of_a_float64_model_puts_no_hook_on_its_parameters() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    batch = torch.randn(5, 4, dtype=torch.float64)
    params = list(model.parameters())
    state = TrainingState.capture(model)
    found = float64_reduced(model, batch, lambda m, b: (m(b) ** 2).sum(), params, state, lambda _, g: g.clone())
    assert [p._backward_hooks for p in params] == [None, None]  # the guard would see the loss change the model
    assert len(found) == 2
