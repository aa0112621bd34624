"""The torch function modes that watch every operation of an evaluation (gradwatch/engine/function/substitution.py,
dataflow.py, fidelity.py) see a tensor wherever an operation receives it: as a positional argument, inside a list or
tuple argument, as a keyword argument; their fast paths for the common case (one tensor, no keyword arguments) change
nothing they report or compute."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from gradwatch.engine.function.dataflow import ReferenceFlow
from gradwatch.engine.function.fidelity import Float64Fidelity
from gradwatch.engine.function.substitution import OriginalsSeen
from gradwatch.errors import OutsideTreeError

ORIGINAL = torch.ones(2, 3)
OTHER = torch.full((2, 3), 2.0)


@pytest.mark.parametrize(
    "operation",
    [
        lambda: torch.add(ORIGINAL, 1.0),
        lambda: torch.add(OTHER, ORIGINAL),
        lambda: torch.cat([OTHER, ORIGINAL]),
        lambda: torch.cat((OTHER, ORIGINAL)),
        lambda: torch.mul(OTHER, other=ORIGINAL),
        lambda: F.linear(OTHER.T, weight=ORIGINAL),
    ],
    ids=["first", "second", "in-list", "in-tuple", "keyword", "functional-keyword"],
)
def test_an_original_raises_wherever_an_operation_receives_it(operation: Callable[[], Tensor]) -> None:
    with (
        pytest.raises(OutsideTreeError, match=r"the loss uses fc\.weight from outside the module tree"),
        OriginalsSeen({id(ORIGINAL): "fc.weight"}),
    ):
        operation()


def test_operations_on_substitutes_and_attribute_reads_pass() -> None:
    with OriginalsSeen({id(ORIGINAL): "fc.weight"}):
        assert ORIGINAL.shape == (2, 3)  # reading an attribute uses no value
        total = torch.cat([OTHER, OTHER * 2], dim=0).sum(dim=0, keepdim=True)
    assert torch.equal(total, torch.full((1, 3), 12.0))


def _data_dependent(loss: Callable[[Tensor], object]) -> str | None:
    x = torch.randn(4, requires_grad=True)
    with ReferenceFlow({}) as watch:
        loss(x)
    return watch.data_dependent


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        (lambda x: torch.nonzero(x > 0), "nonzero()"),  # a boolean tensor computed from x, one tensor result
        (lambda x: torch.cat([torch.ones(1), (x > 0).float()]).nonzero(), "nonzero()"),  # inside a list argument
        (lambda x: torch.where(condition=x > 0, input=x, other=x).sum().item(), "item()"),  # keyword arguments
        (lambda x: x.chunk(2)[1].detach().max().item(), "item()"),  # a tuple result
        (lambda x: torch.ones(3).nonzero(), None),  # nothing computed from x
        (lambda x: torch.ones(3).sum().item(), None),
    ],
)
def test_the_reference_watch_finds_what_vmap_refuses_on_values_computed_from_the_probed(
    loss: Callable[[Tensor], object], expected: str | None
) -> None:
    assert _data_dependent(loss) == expected


def test_float64_fidelity_changes_only_its_operations_with_or_without_keyword_arguments() -> None:
    x = torch.randn(3, dtype=torch.float64)
    with Float64Fidelity(torch.float32) as fidelity:
        plain = torch.tanh(x)  # neither a cast, a factory nor a draw: as it is
        kept = x.float()  # a cast down kept at float64
        created = torch.zeros(3)  # a factory in the default dtype, promoted
        asked = torch.ones(3, dtype=torch.float32)  # asked for float32 beside float64 work: float64
    assert torch.equal(plain, torch.tanh(x))
    assert (kept.dtype, created.dtype, asked.dtype) == (torch.float64,) * 3
    assert fidelity.acted == {"casts", "factories"}


def _stacked_and_merged(operation: Callable[[], Tensor]) -> list[tuple[object, set[str]]]:
    """What ``operation`` gives (its result, or the error it raises) and what the fidelity mode changed, under the
    originals watch stacked on the fidelity mode and under the fidelity mode running the watch's check."""
    outcomes: list[tuple[object, set[str]]] = []
    for merged in (False, True):
        fidelity, watch = Float64Fidelity(torch.float32), OriginalsSeen({id(ORIGINAL): "fc.weight"})
        if merged:
            fidelity.watch = watch.check
        try:
            with fidelity, watch if not merged else contextlib.nullcontext():
                result: object = operation()
        except OutsideTreeError as error:
            result = str(error)
        outcomes.append((result, set(fidelity.acted)))
    return outcomes


@pytest.mark.parametrize(
    "operation",
    [
        lambda: ORIGINAL.float(),  # a cast the fidelity mode would keep: the original refused before it acts
        lambda: torch.add(OTHER.double(), ORIGINAL.double()),
        lambda: torch.zeros(2, 3) + OTHER.double(),  # a factory promoted, nothing original
        lambda: torch.cat([OTHER.double(), ORIGINAL]),
        lambda: ORIGINAL.shape[0] * OTHER.double().float(),  # an attribute read of an original, a cast kept
    ],
    ids=["cast-of-original", "original-in-sum", "factory", "original-in-list", "attribute-read"],
)
def test_the_fidelity_mode_running_the_originals_check_is_the_two_modes_stacked(
    operation: Callable[[], Tensor],
) -> None:
    (stacked, stacked_acted), (merged, merged_acted) = _stacked_and_merged(operation)
    assert stacked_acted == merged_acted
    if isinstance(stacked, Tensor):
        assert isinstance(merged, Tensor)
        assert merged.dtype == stacked.dtype
        assert torch.equal(merged, stacked)
    else:
        assert merged == stacked
