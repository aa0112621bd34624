"""Sharded checks in this process: FSDP2's ``fully_shard`` over a one-rank gloo group (the two-rank runs are in
``tests/lightning/test_fsdp.py``), refused layouts, and the layout arithmetic of shards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from real_models import ScaledWeightGradient
from torch import Tensor, nn

from gradwatch import check_gradients
from gradwatch.engine.notes import NoteCode, codes
from gradwatch.engine.sharding import SHARDED_NOTE
from gradwatch.engine.sharding.collective import Layout, global_loss, summed, value_at
from gradwatch.engine.sharding.parameters import UnsupportedShardingError

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


class Net(nn.Module):
    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.weight = nn.Parameter(torch.randn(5, 10) / 10**0.5)
        self.out = nn.Linear(5, 3)
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(ScaledWeightGradient.apply(torch.tanh(self.inp(x)), self.weight, self.factor)))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh

    store = Path(tmp_path_factory.mktemp("store")) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _sharded(mesh: Any, factor: float = 1.0) -> Net:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = Net(factor)
    for layer in (net.inp, net.out):
        fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def test_a_sharded_model_is_checked_as_the_global_loss_and_left_as_it_was(mesh: Any) -> None:
    net = _sharded(mesh)
    before = [p.to_local().clone() for p in net.parameters()]
    report = check_gradients(net, _batch(), _loss)
    assert report.verdict == "ok", report
    assert codes(report.notes)[0] == NoteCode.SHARDED
    assert report.notes[0].startswith(f"{SHARDED_NOTE} 1 ranks")
    assert report.precision == "native"
    assert {p.kind for p in report.probes} >= {"descent", "tensor", "param", "input"}
    assert all(torch.equal(p.to_local(), b) for p, b in zip(net.parameters(), before, strict=True))
    assert all(p.grad is None for p in net.parameters())


def test_a_wrong_gradient_of_a_sharded_weight_fails_and_is_named(mesh: Any) -> None:
    report = check_gradients(_sharded(mesh, factor=1.03), _batch(), _loss)
    assert report.verdict == "fail"
    assert "weight" in {p.target for p in report.failures}
    assert {p.target for p in report.failures} <= {"*", "weight"}


def test_a_loss_that_every_rank_refuses_on_a_slice_falls_back_as_unsharded(mesh: Any) -> None:
    def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        if len(batch[0]) < 4:
            raise ValueError("needs four samples")
        return _loss(model, batch)

    report = check_gradients(_sharded(mesh), _batch(), loss, probe_batch_size=1)
    assert report.verdict == "ok"
    assert report.samples == 4
    assert report.noted(NoteCode.SLICE_REFUSED), report.notes


def test_tensor_parallel_placements_under_fsdp2_are_refused_with_the_parameter_named(mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    fully_shard(model[0], mesh=mesh)
    model[1].weight = nn.Parameter(distribute_tensor(model[1].weight.detach(), mesh, [Replicate()]))
    model[1].bias = nn.Parameter(distribute_tensor(model[1].bias.detach(), mesh, [Replicate()]))
    with pytest.raises(UnsupportedShardingError, match=r"'1.weight' is placed \(Replicate\(\),\).*tensor-parallel"):
        check_gradients(model, (torch.randn(4, 3),), lambda m, b: m(b[0]).square().mean())


def test_tensor_parallel_placements_alone_are_checked_on_the_whole_parameters(mesh: Any) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = nn.Linear(3, 2)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate()]))
    model.bias = nn.Parameter(distribute_tensor(model.bias.detach(), mesh, [Replicate()]))
    before = list(model.parameters())
    report = check_gradients(model, (torch.randn(4, 3),), lambda m, b: m(b[0]).square().mean())
    assert report.verdict == "ok"
    assert report.noted(NoteCode.TENSOR_PARALLEL)
    after = list(model.parameters())
    assert len(after) == len(before)
    assert all(a is b for a, b in zip(after, before, strict=True))  # the very DTensor parameters back in place
    assert all(type(p).__name__ == "DTensor" for p in after)


def test_a_model_with_plain_and_sharded_parameters_is_refused(mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    fully_shard(model[0], mesh=mesh)
    with pytest.raises(UnsupportedShardingError, match=r"\['1.weight', '1.bias'\] are plain tensors"):
        check_gradients(model, (torch.randn(4, 3),), lambda m, b: m(b[0]).square().mean())


def test_a_layout_maps_global_rows_to_the_shard_that_holds_them() -> None:
    layout = Layout(torch.Size([5, 3]), offset=3, rows=2)
    assert layout.local_index((3, 1)) == (0, 1)
    assert layout.local_index((4, 2)) == (1, 2)
    assert layout.local_index((2, 0)) is None
    assert Layout(torch.Size([1, 4]), offset=1, rows=0).local_index((0, 0)) is None


def test_outside_a_sharded_check_the_reductions_are_the_identity() -> None:
    assert summed([1.5, -2.0]) == [1.5, -2.0]
    assert global_loss(0.25) == 0.25
    assert value_at(torch.arange(6.0).reshape(2, 3), (1, 2)) == 5.0
