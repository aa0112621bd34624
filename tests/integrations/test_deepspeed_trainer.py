"""``GradWatchCallback`` in ``transformers.Trainer(deepspeed=...)`` (ZeRO 1-3, two processes, CPU, gloo, accumulation
2, fp32 and bf16, gradient clipping): the recomputed check at every step passes on healthy fits, which train bit for
bit as without the callback (module parameters, fp32 master parameters, the optimizer's state), and a 3% formula bug
fails every check and names its module. In an Accelerate loop on DeepSpeed, where ``accelerator.backward`` steps the
engine, the applied check runs at the engine's accumulation boundary through ``before_engine_steps``: healthy loops
pass and train as without, a formula bug is named. The fits run in ``tests/deepspeed_trainer_run.py``, one process
per rank.

The applied check inside the Trainer (where DeepSpeed steps inside ``accelerator.backward``) waits for the watch's
applied-check API in the callback; ``gradwatch.integrations.deepspeed.before_engine_steps`` is where it will run
(tested in ``test_deepspeed.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from two_processes import needs_gloo, run_launched

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytestmark = needs_gloo

FITS = [
    f"{kind}-z{stage}-{dtype}" for stage in (1, 2, 3) for dtype in ("fp32", "bf16") for kind in ("healthy", "baseline")
]


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("deepspeed_trainer")
    scenarios = [*FITS, "formula-z2-fp32", "formula-z3-fp32"]
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


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_healthy_trainer_fits_pass_every_check_and_train_as_without(
    fits: dict[str, Any], stage: int, dtype: str
) -> None:
    checked = _ranks(fits, f"healthy-z{stage}-{dtype}")
    for watched, plain in zip(checked, _ranks(fits, f"baseline-z{stage}-{dtype}"), strict=True):
        assert watched["engine"] == "DeepSpeedEngine"
        assert [(r["step"], r["verdict"]) for r in watched["reports"]] == [(1, "ok"), (2, "ok"), (3, "ok")]
        assert all(("zero3-gathered" in r["note_codes"]) == (stage == 3) for r in watched["reports"])
        for key in ("params", "master", "optimizer"):
            assert watched[key] == plain[key], key


@pytest.mark.parametrize("stage", [2, 3])
def test_a_formula_bug_fails_every_check_and_names_the_module(fits: dict[str, Any], stage: int) -> None:
    for rank in _ranks(fits, f"formula-z{stage}-fp32"):
        assert [r["verdict"] for r in rank["reports"]] == ["fail"] * 3
        assert all("custom.weight" in r["failures"] and r["culprits"][0] == "custom" for r in rank["reports"])


@pytest.mark.parametrize("scenario", ["z1-fp32", "z2-fp32", "z3-fp32", "z3-bf16"])
def test_accelerate_loops_check_the_applied_gradient_at_the_engines_boundary(
    accelerate: dict[str, Any], scenario: str
) -> None:
    for watched, plain in zip(
        _ranks(accelerate, f"accelerate-{scenario}"), _ranks(accelerate, f"accelerate_baseline-{scenario}"), strict=True
    ):
        kinds = [(r["step"], r["scope"], r["verdict"]) for r in watched["reports"]]
        assert kinds == [(1, "applied", "ok"), (1, "recomputed", "ok"), (2, "applied", "ok"), (2, "recomputed", "ok"),
                         (3, "applied", "ok")]  # fmt: skip
        for key in ("params", "master", "optimizer"):
            assert watched[key] == plain[key], key


def test_accelerate_loops_name_a_formula_bug(accelerate: dict[str, Any]) -> None:
    for rank in _ranks(accelerate, "accelerate_formula-z2-fp32"):
        first = rank["reports"][0]
        assert (first["step"], first["scope"], first["verdict"], first["fault"]) == (1, "applied", "fail", "formula")
        assert first["culprits"][0] == "custom"
