"""The adaptation of checks to models split by a parallelising library, without one: the hooks of a package are set
aside for the duration of a check and put back exactly, and a model with no DeepSpeed or tensor-parallel parameters
goes through the checks untouched."""

from __future__ import annotations

import torch
from torch import nn

from gradwatch import check_gradients
from gradwatch.engine.distributed import defined_in, hooks_set_aside
from gradwatch.engine.distributed.tensor_parallel import is_tensor_parallel
from gradwatch.engine.distributed.zero import is_engine, owned_range, unwrapped


def test_only_the_named_packages_hooks_are_set_aside_and_the_very_dictionaries_come_back() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    calls: list[str] = []
    foreign = lambda *_: calls.append("foreign")  # noqa: E731
    foreign.__module__ = "deepspeed.runtime.zero.parameter_offload"
    model[0].register_forward_pre_hook(foreign)
    model[0].register_forward_hook(lambda *_: calls.append("user"))
    before = (model[0]._forward_pre_hooks, model[0]._forward_hooks)
    with hooks_set_aside(model, "deepspeed"):
        model(torch.ones(1, 3))
        assert model[0]._forward_pre_hooks is not before[0]
    assert calls == ["user"]
    assert (model[0]._forward_pre_hooks, model[0]._forward_hooks) == before
    assert model[0]._forward_pre_hooks is before[0]
    model(torch.ones(1, 3))
    assert calls == ["user", "foreign", "user"]
    assert defined_in(foreign, "deepspeed")
    assert not defined_in(foreign, "deep")


def test_a_plain_model_is_neither_deepspeeds_nor_tensor_parallel_and_is_checked_as_before() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    assert not is_engine(model)
    assert unwrapped(model) is model
    assert not is_tensor_parallel(model)
    assert all(owned_range(p) is None for p in model.parameters())
    batch = (torch.randn(8, 4), torch.randn(8, 2))
    report = check_gradients(model, batch, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    assert report.verdict == "ok"
    assert not report.noted("zero3-gathered")
    assert not report.noted("tensor-parallel")
