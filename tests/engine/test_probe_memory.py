"""What a check's probes hold in memory: one copy of what they move at a time, and no float64 copy for a float64
substitute (restored from its parameter instead): ``benchmarks/memory.py`` measures the peaks on GPT-like models."""

from __future__ import annotations

import torch
from torch import nn

from gradwatch.engine.function.precision import exact_source, float64_storage
from gradwatch.engine.measuring.directions import KEPT_COPY_ELEMENTS, VectorDirection


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
