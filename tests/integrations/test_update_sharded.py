"""The update check under sharding (two processes, CPU, gloo; the loops in ``tests/update_sharded_run.py``): FSDP2
(``fully_shard``, DTensor parameters and AdamW state), tensor parallelism (a column- and a row-parallel layer) and
DeepSpeed ZeRO-1/2 (fp32 partitions of the parameters and of Adam's state, gradient clipping, two param groups).
Healthy runs pass every update check and train bit for bit as without gradwatch; rank 1's share of each update scaled
by 1.1 after the step is caught at the first update check after it, on every rank alike, naming rank 1; an optimizer
gradwatch has no rule for (the one DeepSpeed builds for ``Adagrad``, torch's Adagrad under FSDP2; DeepSpeed's
``FusedAdam`` where its CPU op is built) is checked by the single-device replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from two_processes import needs_gloo, run_launched

pytestmark = [needs_gloo, pytest.mark.slow]

FSDP = ["fsdp-healthy", "fsdp-baseline", "fsdp-scaled", "fsdp-own", "tp-healthy", "tp-baseline", "tp-scaled"]
ZERO = [f"z{stage}-{kind}" for stage in (1, 2) for kind in ("healthy", "baseline", "scaled", "own")]


def _fused_adam_built() -> bool:
    """Whether DeepSpeed's CPU ``FusedAdam`` op is already compiled (its first build takes minutes on a small CPU)."""
    import torch.utils.cpp_extension as extension

    found = Path(extension._get_build_directory("fused_adam", verbose=False))
    return any(found.glob("fused_adam*.so"))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    scenarios = list(FSDP)
    if _has_deepspeed():
        scenarios += ZERO + (["z2-fused", "z2-fusedscaled"] if _fused_adam_built() else [])
    out = tmp_path_factory.mktemp("update_sharded")
    return run_launched("update_sharded_run.py", out, *scenarios, timeout_s=400, env={"DS_ACCELERATOR": "cpu"})[0]


def _has_deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def _ranks(results: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    if f"{scenario}_rank0" not in results:
        pytest.skip(f"{scenario} not run here (needs deepspeed, and for fused its CPU op built)")
    return [results[f"{scenario}_rank{rank}"] for rank in (0, 1)]


def _updates(rank: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in rank["reports"] if r["scope"] == "update"]


@pytest.mark.parametrize("engine", ["fsdp", "tp", "z1", "z2"])
def test_healthy_sharded_runs_pass_every_update_check_and_train_as_without(
    results: dict[str, Any], engine: str
) -> None:
    for watched, baseline in zip(_ranks(results, f"{engine}-healthy"), _ranks(results, f"{engine}-baseline"),
                                 strict=True):  # fmt: skip
        updates = _updates(watched)
        assert [(r["step"], r["verdict"]) for r in updates] == [(1, "ok"), (2, "ok"), (3, "ok")]
        assert all("AdamW in float64" in " ".join(r["notes"]) for r in updates)
        for key in ("params", "optimizer", "master"):
            assert watched.get(key) == baseline.get(key), key
    if engine.startswith("z"):  # the engine clipped at steps 2 and 3: the checks stepped with its clip coefficient
        assert [norm > 0.3 for norm in watched["grad_norms"]] == [False, True, True]


@pytest.mark.parametrize("engine", ["fsdp", "tp", "z1", "z2"])
def test_rank1_share_of_the_update_scaled_is_caught_naming_rank1(results: dict[str, Any], engine: str) -> None:
    ranks = _ranks(results, f"{engine}-scaled")
    for rank in ranks:
        updates = _updates(rank)
        assert [(r["step"], r["verdict"]) for r in updates] == [(1, "ok"), (2, "ok"), (3, "fail")]
        failed = updates[-1]
        assert failed["fault"] == "update"
        assert "rank(s) [1] made the part of the update that differs" in failed["message"]
        assert "update-ranks" in failed["note_codes"]
        # FSDP2 splits each tensor's rows between the ranks, tensor parallelism inp's rows and hidden.weight's
        # columns; ZeRO gives inp.* to rank 0 and splits hidden.weight
        zero = engine.startswith("z")
        assert failed["failures"] == (["hidden.weight"] if zero else ["hidden.weight", "inp.bias", "inp.weight"])
        assert f"the update of `{'hidden.weight' if zero else 'inp.weight'}`" in failed["message"]
        assert "cosine 1," not in failed["message"]  # a share, not the whole tensor, is off
    assert _updates(ranks[0]) == _updates(ranks[1])  # every rank compared the same whole tensors


@pytest.mark.parametrize("scenario", ["fsdp-own", "z1-own", "z2-own", "z2-fused"])
def test_an_optimizer_without_a_rule_is_checked_by_the_replay(results: dict[str, Any], scenario: str) -> None:
    expected = {"own": "Adagrad", "fused": "FusedAdam"}[scenario.split("-")[1]]
    for rank in _ranks(results, scenario):
        updates = _updates(rank)
        assert [r["verdict"] for r in updates] == ["ok", "ok", "ok"]
        assert all(f"a single-device replay of {expected}" in " ".join(r["notes"]) for r in updates)


def test_a_wrong_share_of_a_replayed_optimizers_update_names_the_rank(results: dict[str, Any]) -> None:
    for rank in _ranks(results, "z2-fusedscaled"):
        updates = _updates(rank)
        assert [(r["step"], r["verdict"]) for r in updates] == [(1, "ok"), (2, "ok"), (3, "fail")]
        assert "a single-device replay of FusedAdam" in updates[-1]["message"]
        assert "rank(s) [1] made the part of the update that differs" in updates[-1]["message"]
