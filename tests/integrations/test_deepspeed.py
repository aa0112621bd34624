"""gradwatch in plain DeepSpeed ZeRO loops (stages 1-3, two processes, CPU, gloo, accumulation 2, fp32 and bf16), on
the watch (``docs/deepspeed.md``'s recipe): the applied check of ``safe_get_full_grad`` at every accumulation boundary
and recomputed checks, with no false alarm on
healthy runs, which train bit for bit as without gradwatch (module parameters, fp32 master parameters, Adam's state);
and each planted fault caught at the first applied check and named: the last micro-batch left out of the reduction
(``reduction``), one rank's partition of a gradient scaled after the reduction (``reduction``, naming the rank), a 3%
formula bug (``formula``, naming the module; in bf16 on the model's float32 twin). The loops run in
``tests/deepspeed_run.py``, one process per rank."""

from __future__ import annotations

from typing import Any

import pytest
from two_processes import needs_gloo, run_launched

pytest.importorskip("deepspeed")
pytestmark = [needs_gloo, pytest.mark.slow]

STAGES = (1, 2, 3)
FAULTS = ("leftout", "scaled", "formula")


def _run(tmp_path_factory: pytest.TempPathFactory, name: str, scenarios: list[str]) -> dict[str, Any]:
    out = tmp_path_factory.mktemp(name)
    return run_launched("deepspeed_run.py", out, *scenarios, timeout_s=180, env={"DS_ACCELERATOR": "cpu"})[0]


@pytest.fixture(scope="module")
def fp32(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    kinds = ("healthy", "baseline", "hooked", *FAULTS)
    return _run(tmp_path_factory, "fp32", [f"{kind}-z{stage}-fp32" for stage in STAGES for kind in kinds])


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    kinds = ("healthy", "baseline", "leftout", "scaled", "formula")
    return _run(tmp_path_factory, "bf16", [f"{kind}-z{stage}-bf16" for stage in STAGES for kind in kinds])


def _ranks(results: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    return [results[f"{scenario}_rank{rank}"] for rank in (0, 1)]


def _kinds(rank: dict[str, Any]) -> list[tuple[int, str, str]]:
    return [(r["step"], r["scope"], r["verdict"]) for r in rank["reports"]]


HEALTHY = [
    (1, "applied", "ok"), (1, "recomputed", "ok"), (2, "applied", "ok"), (2, "recomputed", "ok"), (3, "applied", "ok")
]  # fmt: skip


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", STAGES)
def test_healthy_zero_runs_pass_every_check_and_train_as_without(
    fp32: dict[str, Any], bf16: dict[str, Any], stage: int, dtype: str
) -> None:
    results = fp32 if dtype == "fp32" else bf16
    checked, plain = _ranks(results, f"healthy-z{stage}-{dtype}"), _ranks(results, f"baseline-z{stage}-{dtype}")
    for watched, baseline in zip(checked, plain, strict=True):
        assert _kinds(watched) == HEALTHY
        assert all(0 < r["floor_excess"] < 1 for r in watched["reports"] if r["scope"] == "applied")
        for key in ("params", "master", "optimizer"):
            assert watched[key] == baseline[key], key
        gathered = ["zero3-gathered" in r["note_codes"] for r in watched["reports"]]
        assert gathered == [stage == 3] * len(gathered)
        # ZeRO-1/2: the update of each verified gradient checked too (clipped at 0.5), from the fp32 master weights
        updates = [(r["step"], r["verdict"]) for r in watched["updates"]]
        assert updates == ([] if stage == 3 else [(1, "ok"), (2, "ok"), (3, "ok")])
    assert [r["floor_excess"] for r in checked[0]["reports"]] == [r["floor_excess"] for r in checked[1]["reports"]]


@pytest.mark.parametrize("stage", STAGES)
def test_a_check_run_inside_engine_step_sits_after_the_reduction_and_before_clipping(
    fp32: dict[str, Any], stage: int
) -> None:
    """Clipping (at 0.5) changes these gradients: a check that saw them clipped would fail."""
    for hooked, plain in zip(
        _ranks(fp32, f"hooked-z{stage}-fp32"), _ranks(fp32, f"baseline-z{stage}-fp32"), strict=True
    ):
        assert _kinds(hooked) == HEALTHY
        assert min(hooked["grad_norms"]) > 0.5  # every step clipped
        for key in ("params", "master", "optimizer"):
            assert hooked[key] == plain[key], key


def test_the_bf16_floor_is_the_paths(fp32: dict[str, Any], bf16: dict[str, Any]) -> None:
    floors32 = [r["noise_floor"] for r in fp32["healthy-z2-fp32_rank0"]["reports"] if r["scope"] == "applied"]
    floors16 = [r["noise_floor"] for r in bf16["healthy-z2-bf16_rank0"]["reports"] if r["scope"] == "applied"]
    assert max(floors32) < 1e-5 < 1e-3 < min(floors16)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", STAGES)
def test_the_last_micro_batch_left_out_of_the_reduction_is_caught_at_the_first_check(
    fp32: dict[str, Any], bf16: dict[str, Any], stage: int, dtype: str
) -> None:
    for rank in _ranks(fp32 if dtype == "fp32" else bf16, f"leftout-z{stage}-{dtype}"):
        first = rank["reports"][0]
        assert (first["step"], first["scope"], first["verdict"], first["fault"]) == (1, "applied", "fail", "reduction")
        assert [r["verdict"] for r in rank["reports"][1:]] == ["ok"] * 4  # the fault was planted once


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", STAGES)
def test_one_ranks_partition_scaled_after_the_reduction_is_caught_and_the_rank_named(
    fp32: dict[str, Any], bf16: dict[str, Any], stage: int, dtype: str
) -> None:
    for rank in _ranks(fp32 if dtype == "fp32" else bf16, f"scaled-z{stage}-{dtype}"):
        first = rank["reports"][0]
        assert (first["step"], first["verdict"], first["fault"]) == (1, "fail", "reduction")
        assert "out.weight" in first["failures"]
        assert set(first["failures"]) <= {"*", "out.weight"}
        assert first["message"].startswith("rank(s) [1] own the partitions")
        assert [r["verdict"] for r in rank["reports"][1:]] == ["ok"] * 4


@pytest.mark.parametrize("stage", STAGES)
def test_a_formula_bug_fails_both_kinds_of_check_and_names_the_module(fp32: dict[str, Any], stage: int) -> None:
    for rank in _ranks(fp32, f"formula-z{stage}-fp32"):
        assert [r["verdict"] for r in rank["reports"]] == ["fail"] * 5
        for report in rank["reports"]:
            assert "custom.weight" in report["failures"]
            assert report["culprits"][0] == "custom"
            assert report["fault"] == ("formula" if report["scope"] == "applied" else None)


@pytest.mark.parametrize("stage", STAGES)
def test_a_bf16_formula_bug_is_caught_at_the_first_applied_check_and_the_module_named(
    bf16: dict[str, Any], stage: int
) -> None:
    """A 3% error is below a bf16 gradient's own (the recomputed check's tolerance is 10%); the applied check's float64
    probes see it, and its culprit search runs on the model's float32 twin."""
    for rank in _ranks(bf16, f"formula-z{stage}-bf16"):
        first = rank["reports"][0]
        assert (first["step"], first["scope"], first["verdict"], first["fault"]) == (1, "applied", "fail", "formula")
        assert first["failures"] == ["custom.weight"]
        assert first["culprits"][0] == "custom"
        assert "culprit-float32-twin" in first["note_codes"]
        for report in rank["reports"]:
            assert report["verdict"] == "ok" or report["culprits"][0] == "custom"


@pytest.fixture(scope="module")
def clipping(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    scenarios = ["clipped-z2-fp32", *(f"clipnorm-z{stage}-fp32" for stage in STAGES), "clipnormhooked-z3-fp32"]
    return _run(tmp_path_factory, "clipping", scenarios)


def _clip_reports(rank: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in rank["reports"] if "applied-clipping" in r["note_codes"]]


def test_the_norm_a_zero_engine_clipped_with_is_checked_and_correct_clipping_is_clean(
    clipping: dict[str, Any],
) -> None:
    for rank in _ranks(clipping, "clipped-z2-fp32"):
        clips = _clip_reports(rank)
        assert [(r["step"], r["verdict"]) for r in clips] == [(1, "ok"), (2, "ok"), (3, "ok")]
        assert all(r["verdict"] == "ok" for r in rank["reports"])


@pytest.mark.parametrize("scenario", [*(f"clipnorm-z{stage}-fp32" for stage in STAGES), "clipnormhooked-z3-fp32"])
def test_a_clip_norm_counted_twice_by_the_engine_fails_with_fault_clipping(
    clipping: dict[str, Any], scenario: str
) -> None:
    for rank in _ranks(clipping, scenario):
        clips = _clip_reports(rank)
        assert [(r["step"], r["verdict"], r["fault"]) for r in clips] == [
            (1, "fail", "clipping"), (2, "ok", None), (3, "ok", None)
        ]  # fmt: skip
        assert "the engine clipped with the norm" in clips[0]["message"]
        applied = [r for r in rank["reports"] if r["scope"] == "applied" and r not in clips]
        assert [r["verdict"] for r in applied] == ["ok"] * 3  # the gradient before clipping was right


@pytest.fixture(scope="module")
def new_user(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    kinds = ("healthy", "baseline", "engine", "enginescaled")
    scenarios = [f"{kind}-z{stage}-fp32" for stage in STAGES for kind in kinds]
    return _run(tmp_path_factory, "new_user", [*scenarios, "module-z2-fp32", "module-z3-fp32"])


@pytest.mark.parametrize("stage", STAGES)
def test_the_engine_handed_to_the_watch_is_checked_as_the_documented_recipe_checks_it(
    new_user: dict[str, Any], stage: int
) -> None:
    """``watch.before_optimizer_step(engine, loss_fn, step=step)``, as a new user calls it: the watch reads the engine's
    full gradients itself (the same verdicts and floors as ``gradients=FullGradients(engine)``), the clip check reads
    the norm the engine clipped with, and training is bit for bit as without gradwatch."""
    engine, documented = _ranks(new_user, f"engine-z{stage}-fp32"), _ranks(new_user, f"healthy-z{stage}-fp32")
    for watched, recipe, plain in zip(engine, documented, _ranks(new_user, f"baseline-z{stage}-fp32"), strict=True):
        clips = _clip_reports(watched)
        checks = [r for r in watched["reports"] if r not in clips]
        assert _kinds({"reports": checks}) == HEALTHY
        assert [r["floor_excess"] for r in checks] == [r["floor_excess"] for r in recipe["reports"]]
        assert [(r["step"], r["verdict"]) for r in clips] == [(1, "ok"), (2, "ok"), (3, "ok")]
        assert not watched["warnings"]
        for key in ("params", "master", "optimizer"):
            assert watched[key] == plain[key], key


@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_in_the_engine_handed_to_the_watch_is_caught(new_user: dict[str, Any], stage: int) -> None:
    for rank in _ranks(new_user, f"enginescaled-z{stage}-fp32"):
        first = rank["reports"][0]
        assert (first["step"], first["verdict"], first["fault"]) == (1, "fail", "reduction")
        assert first["message"].startswith("rank(s) [1] own the partitions")


@pytest.mark.parametrize("stage", [2, 3])
def test_a_gradient_the_watch_cannot_read_is_said_once_with_the_remedy(new_user: dict[str, Any], stage: int) -> None:
    """The wrapped module handed over without its gradients: under ZeRO-2/3 it has no ``.grad``; every applied check
    is inconclusive, and the watch says why once, naming the engine and ``FullGradients``."""
    for rank in _ranks(new_user, f"module-z{stage}-fp32"):
        applied = [r for r in rank["reports"] if r["scope"] == "applied"]
        assert [r["verdict"] for r in applied] == ["inconclusive"] * 3
        said = [text for text in rank["warnings"] if "reads no gradient" in text]
        assert len(said) == 1, rank["warnings"]
        assert "before_optimizer_step(engine" in said[0]
        assert "FullGradients(engine)" in said[0]
