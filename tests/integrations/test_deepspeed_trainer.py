"""``GradWatchCallback`` in ``transformers.Trainer(deepspeed=...)`` (ZeRO 1-3, two processes, CPU, gloo, accumulation
2, fp32 and bf16, gradient clipping): the recomputed check at every step passes on healthy fits, which train bit for
bit as without the callback (module parameters, fp32 master parameters, the optimizer's state), and a 3% formula bug
fails every check and names its module. In an Accelerate loop on DeepSpeed, where ``accelerator.backward`` steps the
engine, the applied check runs at the engine's accumulation boundary through ``before_engine_steps``: healthy loops
pass and train as without, a formula bug is named. The fits run in ``tests/deepspeed_trainer_run.py``, one process
per rank.

The applied check inside the Trainer, where DeepSpeed steps inside ``accelerator.backward``, is not yet
``GradWatchCallback``'s: a small callback of the driver records each micro-batch where the Trainer computes its loss
and runs it inside the engine's step (``applied_checks_inside_steps``): healthy fits pass and train as without, the last
micro-batch left out of the reduction and one rank's partition scaled are caught at the first applied check."""

from __future__ import annotations

from typing import Any

import pytest
from two_processes import needs_gloo, run_launched

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytestmark = [needs_gloo, pytest.mark.slow]

FITS = [
    f"{kind}-z{stage}-{dtype}" for stage in (1, 2, 3) for dtype in ("fp32", "bf16") for kind in ("healthy", "baseline")
]


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("deepspeed_trainer")
    scenarios = [*FITS, "formula-z2-fp32", "formula-z3-fp32"]
    return run_launched("deepspeed_trainer_run.py", out, *scenarios, timeout_s=180, env={"DS_ACCELERATOR": "cpu"})[0]


@pytest.fixture(scope="module")
def applied(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("deepspeed_trainer_applied")
    scenarios = [f"applied-z{stage}-fp32" for stage in (1, 2, 3)] + ["applied-z1-bf16", "applied-z3-bf16"]
    scenarios += [f"applied_{fault}-z{stage}-fp32" for fault in ("leftout", "scaled") for stage in (1, 2, 3)]
    return run_launched("deepspeed_trainer_run.py", out, *scenarios, timeout_s=180, env={"DS_ACCELERATOR": "cpu"})[0]


@pytest.fixture(scope="module")
def accelerate(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("deepspeed_accelerate")
    kinds = ("accelerate", "accelerate_baseline")
    scenarios = [f"{kind}-z{stage}-fp32" for stage in (1, 2, 3) for kind in kinds]
    scenarios += ["accelerate-z3-bf16", "accelerate_baseline-z3-bf16", "accelerate_formula-z2-fp32"]
    return run_launched("deepspeed_trainer_run.py", out, *scenarios, timeout_s=180, env={"DS_ACCELERATOR": "cpu"})[0]


def _ranks(fits: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    return [fits[f"{scenario}_rank{rank}"] for rank in (0, 1)]


def _checks(rank: dict[str, Any]) -> list[dict[str, Any]]:
    """The rank's checks of the gradient, without the checks of the norm the engine clipped with."""
    return [r for r in rank["reports"] if "applied-clipping" not in r["note_codes"]]


def _clip_checks(rank: dict[str, Any]) -> list[tuple[int, str]]:
    return [(r["step"], r["verdict"]) for r in rank["reports"] if "applied-clipping" in r["note_codes"]]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_healthy_trainer_fits_pass_every_check_and_train_as_without(
    fits: dict[str, Any], stage: int, dtype: str
) -> None:
    checked = _ranks(fits, f"healthy-z{stage}-{dtype}")
    for watched, plain in zip(checked, _ranks(fits, f"baseline-z{stage}-{dtype}"), strict=True):
        assert watched["engine"] == "DeepSpeedEngine"
        recomputed = [r for r in watched["reports"] if r["scope"] == "recomputed"]
        assert [(r["step"], r["verdict"]) for r in recomputed] == [(1, "ok"), (2, "ok"), (3, "ok")]
        # by default the applied check too, at the first step, and the norm the engine clipped with after it
        assert [(r["step"], r["scope"], r["verdict"]) for r in _checks(watched) if r["scope"] == "applied"] == [
            (1, "applied", "ok")
        ]  # fmt: skip
        assert _clip_checks(watched) == [(1, "ok")]
        assert all(("zero3-gathered" in r["note_codes"]) == (stage == 3) for r in _checks(watched))
        # ZeRO-1/2: each verified gradient's update checked too, never failing
        assert all(verdict != "fail" for _, verdict, _ in watched["updates"]), watched["updates"]
        assert bool(watched["updates"]) == (stage != 3)
        for key in ("params", "master", "optimizer"):
            assert watched[key] == plain[key], key


@pytest.mark.parametrize("stage", [2, 3])
def test_a_formula_bug_fails_every_check_and_names_the_module(fits: dict[str, Any], stage: int) -> None:
    for rank in _ranks(fits, f"formula-z{stage}-fp32"):
        checks = _checks(rank)
        assert [(r["scope"], r["verdict"]) for r in checks] == [("applied", "fail")] + [("recomputed", "fail")] * 3
        assert all("custom.weight" in r["failures"] and r["culprits"][0] == "custom" for r in checks)


@pytest.mark.parametrize("scenario", ["z1-fp32", "z2-fp32", "z3-fp32", "z3-bf16"])
def test_accelerate_loops_check_the_applied_gradient_at_the_engines_boundary(
    accelerate: dict[str, Any], scenario: str
) -> None:
    for watched, plain in zip(
        _ranks(accelerate, f"accelerate-{scenario}"), _ranks(accelerate, f"accelerate_baseline-{scenario}"), strict=True
    ):
        kinds = [(r["step"], r["scope"], r["verdict"]) for r in _checks(watched)]
        assert kinds == [(1, "applied", "ok"), (1, "recomputed", "ok"), (2, "applied", "ok"), (2, "recomputed", "ok"),
                         (3, "applied", "ok")]  # fmt: skip
        assert _clip_checks(watched) == [(1, "ok"), (2, "ok"), (3, "ok")]  # the norm the engine clipped with
        for key in ("params", "master", "optimizer"):
            assert watched[key] == plain[key], key


def test_accelerate_loops_name_a_formula_bug(accelerate: dict[str, Any]) -> None:
    for rank in _ranks(accelerate, "accelerate_formula-z2-fp32"):
        first = rank["reports"][0]
        assert (first["step"], first["scope"], first["verdict"], first["fault"]) == (1, "applied", "fail", "formula")
        assert first["culprits"][0] == "custom"


@pytest.mark.parametrize("scenario", ["z1-fp32", "z2-fp32", "z3-fp32", "z1-bf16", "z3-bf16"])
def test_trainer_fits_check_the_applied_gradient_inside_the_engines_step_and_train_as_without(
    fits: dict[str, Any], applied: dict[str, Any], scenario: str
) -> None:
    for watched, plain in zip(
        _ranks(applied, f"applied-{scenario}"), _ranks(fits, f"baseline-{scenario}"), strict=True
    ):
        assert [(r["step"], r["scope"], r["verdict"]) for r in _checks(watched)] == [
            (1, "applied", "ok"), (2, "applied", "ok"), (3, "applied", "ok")
        ], [r["message"] for r in watched["reports"]]  # fmt: skip
        assert _clip_checks(watched) == [(1, "ok"), (2, "ok"), (3, "ok")]  # the norm the engine clipped with
        for key in ("params", "master", "optimizer"):
            assert watched[key] == plain[key], key


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("fault", ["leftout", "scaled"])
def test_trainer_fits_catch_a_reduction_fault_at_the_first_applied_check(
    applied: dict[str, Any], fault: str, stage: int
) -> None:
    for rank in _ranks(applied, f"applied_{fault}-z{stage}-fp32"):
        first = _checks(rank)[0]
        assert (first["step"], first["verdict"], first["fault"]) == (1, "fail", "reduction")
        assert [r["verdict"] for r in _checks(rank)[1:]] == ["ok", "ok"]
        if fault == "scaled":
            assert first["message"].startswith("rank(s) [1] own the partitions")
