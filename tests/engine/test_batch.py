"""Finding and replacing the floating tensors of nested batches."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from gradwatch.engine.function.batch import floating_tensors, replace_tensors

Pair = collections.namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass(frozen=True)
class Record:
    image: torch.Tensor
    label: torch.Tensor
    name: str = "sample"


def test_paths_of_floating_tensors_in_nested_structures() -> None:
    image = torch.randn(2, 3)
    batch = {
        "pair": Pair(torch.randn(2), torch.randint(0, 3, (2,))),
        "list": [torch.randn(1), "text", 3],
        "record": Record(image, torch.tensor([1, 2])),
        "again": image,  # the same tensor twice is listed once
    }
    found = floating_tensors(batch)
    assert list(found) == ["batch['pair'].x", "batch['list'][0]", "batch['record'].image"]
    assert found["batch['record'].image"] is image


def test_a_bare_tensor_is_the_batch() -> None:
    x = torch.randn(3)
    assert floating_tensors(x) == {"batch": x}
    assert floating_tensors(torch.arange(3)) == {}


def test_replace_builds_a_new_batch_and_leaves_the_original_alone() -> None:
    shared = torch.randn(2)
    batch = {
        "pair": Pair(torch.randn(2), torch.randn(2)),
        "record": Record(shared, torch.randn(1)),
        "again": shared,
        "n": 1,
    }
    new = torch.zeros(2)
    replaced = replace_tensors(batch, {"batch['record'].image": new})
    assert replaced["record"].image is new
    assert replaced["again"] is new  # every occurrence of the replaced tensor
    assert isinstance(replaced["record"], Record)
    assert replaced["record"].name == "sample"
    assert replaced["pair"] is batch["pair"]  # untouched branches keep their identity
    assert batch["record"].image is shared
    assert replaced["n"] == 1


def test_replace_rejects_unknown_paths() -> None:
    with pytest.raises(KeyError, match="no floating tensor at"):
        replace_tensors((torch.randn(2),), {"batch[5]": torch.randn(2)})


def test_list_and_tuple_types_are_preserved() -> None:
    batch = ([torch.randn(1), torch.randn(1)], (torch.randn(1),))
    replaced = replace_tensors(batch, {"batch[0][1]": torch.ones(1), "batch[1][0]": torch.zeros(1)})
    assert isinstance(replaced, tuple)
    assert isinstance(replaced[0], list)
    assert isinstance(replaced[1], tuple)
    assert torch.equal(replaced[0][1], torch.ones(1))
