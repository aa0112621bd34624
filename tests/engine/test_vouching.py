"""The groups of tensors the combined probes of an applied check leave unvouched (engine/applied/measured.py): each
group is one a balanced probe over it alone vouches for at its floors, the tensors with a large floor are kept out of
the precise tensors' group, and a small CNN with BatchNorm passes while a 2% fault in one of its tensors is caught and
named at the first check."""

from __future__ import annotations

import math
import random

import torch
from applied_models import ConvBatchNorm
from torch.nn import functional as F

from gradwatch.engine.applied import AppliedWindow
from gradwatch.engine.applied.measured import Combined, balanced_weights, floor_along, unvouched, vouching_groups


def _probe_over(group: list[int], grad_norms: list[float], floors: list[float], multiple: float) -> Combined:
    """A balanced probe over ``group`` alone that agrees, its tolerance its floor times ``multiple`` (no noise)."""
    weights = balanced_weights([n if i in group else 0.0 for i, n in enumerate(grad_norms)])
    part = 1.0 / math.sqrt(len(group))
    tolerance = multiple * floor_along([floors[i] for i in group], [part] * len(group))
    return Combined("ok", 0.1, tolerance, {i: weights[i] for i in group})


def test_each_group_is_vouched_for_by_a_balanced_probe_over_it() -> None:
    rng = random.Random(0)
    for _ in range(200):
        count = rng.randint(2, 40)
        grad_norms = [10 ** rng.uniform(-4, 1) for _ in range(count)]
        floors = [n * 10 ** rng.uniform(-8, -1) for n in grad_norms]
        multiple = rng.choice([2.0, 4.0])
        candidates = sorted(rng.sample(range(count), rng.randint(2, count)))
        groups = vouching_groups(candidates, grad_norms, floors, multiple)
        grouped = [i for group in groups for i in group]
        assert len(grouped) == len(set(grouped))
        assert set(grouped) <= set(candidates)
        for group in groups:
            assert len(group) >= 2
            probe = _probe_over(group, grad_norms, floors, multiple)
            assert not set(unvouched([probe], grad_norms, floors, multiple)) & set(group)


def test_tensors_with_a_large_floor_are_kept_out_of_the_precise_tensors_group() -> None:
    grad_norms = [1.0] * 10
    floors = [1e-7] * 8 + [1e-3, 3e-3]  # float32 rounding, and two convolutions before BatchNorm
    groups = vouching_groups(range(10), grad_norms, floors, 2.0)
    assert groups == [list(range(8))]


def _check(hooked: str | None, seed: int) -> tuple[str, list[str]]:
    torch.manual_seed(seed)
    model = ConvBatchNorm()
    batch = (torch.randn(32, 3, 12, 12), torch.randint(0, 10, (32,)))
    handle = None
    if hooked is not None:
        handle = dict(model.named_parameters())[hooked].register_hook(lambda grad: grad * 1.02)
    window = AppliedWindow(model)
    window.record(batch)
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    if handle is not None:
        handle.remove()
    report = window.check(lambda m, b: F.cross_entropy(m(b[0]), b[1]), culprit_search=False)
    return report.verdict, [p.target for p in report.probes if p.verdict == "fail"]


def test_a_model_with_large_floor_tensors_passes_and_a_2_percent_fault_in_a_precise_tensor_is_caught() -> None:
    for seed in range(3):
        assert _check(None, seed)[0] == "ok"
    for name in ("fc1.weight", "conv2.bias"):
        verdict, failing = _check(name, 0)
        assert verdict == "fail"
        assert name in failing
