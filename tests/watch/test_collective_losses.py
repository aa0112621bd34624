"""Losses with collectives inside, under DDP (two processes, CPU, gloo): an NT-Xent loss over embeddings gathered
from both ranks with a hand-written ``GatherLayer`` (``tests/gather_loss_run.py``), each rank on its own data, both
kinds of check at step 1 of a plain-PyTorch loop, of a Lightning fit (``tests/gather_loss_lightning_run.py``) and of a
``transformers.Trainer`` fit (``tests/gather_loss_trainer_run.py``), and ``check_gradients`` called directly on each
rank. The correct layer fails no check; each published wrong backward (this rank's slot only, ``all_reduce``'s ``None``,
the slots summed) fails at the first check, on every rank alike; nothing hangs (a bounded timeout), and training is
bit-identical with and without the watch."""

from __future__ import annotations

from typing import Any

import pytest
from two_processes import needs_gloo, run_launched, run_ranks

pytestmark = [needs_gloo, pytest.mark.slow]

SCENARIOS = ("correct", "local_slot", "all_reduce_none", "summed_slots", "correct_dropout")


@pytest.fixture(scope="module")
def found(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gather_loss")
    return run_launched("gather_loss_run.py", out, *SCENARIOS, timeout_s=480)[0]


def _both(found: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    return [found[f"{scenario}_rank{rank}"] for rank in (0, 1)]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_training_is_unchanged_by_the_watch(found: dict[str, Any], scenario: str) -> None:
    for rank in _both(found, scenario):
        assert rank["identical"], scenario


@pytest.mark.parametrize("scenario", ["correct", "correct_dropout"])
def test_the_correct_gather_layer_fails_no_check(found: dict[str, Any], scenario: str) -> None:
    for rank in _both(found, scenario):
        assert rank["applied"]["verdict"] == "ok", rank["applied"]["report"]
        # the per-rank check failed this correct layer (its backward carries the other rank's loss); the global one not
        assert rank["recomputed"]["verdict"] == "ok", rank["recomputed"]["report"]
        assert any(note.startswith("the loss calls collectives") for note in rank["recomputed"]["notes"])


@pytest.mark.parametrize("scenario", ["local_slot", "all_reduce_none", "summed_slots"])
def test_each_published_wrong_backward_fails_at_the_first_check_on_every_rank(
    found: dict[str, Any], scenario: str
) -> None:
    ranks = _both(found, scenario)
    for rank in ranks:
        for kind in ("applied", "recomputed"):
            assert rank[kind]["verdict"] == "fail", rank[kind]["report"]
            assert rank[kind]["fault"] == "formula", rank[kind]["report"]
    for kind in ("applied", "recomputed"):
        assert ranks[0][kind]["verdict"] == ranks[1][kind]["verdict"]
        assert ranks[0][kind]["fault"] == ranks[1][kind]["fault"]


BACKWARDS = ("correct", "local_slot", "all_reduce_none", "summed_slots")


@pytest.fixture(scope="module")
def lightning(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gather_loss_lightning")
    scenarios = [f"{kind}_{backward}" for kind in ("fit", "direct") for backward in BACKWARDS] + [
        "direct_split",
        "direct_raise",
    ]
    return run_ranks("gather_loss_lightning_run.py", out, *scenarios, timeout_s=540)[0]


def test_the_correct_gather_layer_fails_no_check_under_lightning_and_training_is_unchanged(
    lightning: dict[str, Any],
) -> None:
    for rank in _both(lightning, "fit_correct"):
        assert rank["identical"]
        assert rank["applied"]["verdict"] == "ok", rank["applied"]["report"]
        # the per-rank check failed this correct layer here too, with a confident culprit (the bare module's loss)
        assert rank["recomputed"]["verdict"] == "ok", rank["recomputed"]["report"]
        assert any(note.startswith("the loss calls collectives") for note in rank["recomputed"]["notes"])


@pytest.mark.parametrize("backward", BACKWARDS[1:])
def test_each_published_wrong_backward_fails_at_the_first_check_under_lightning(
    lightning: dict[str, Any], backward: str
) -> None:
    ranks = _both(lightning, f"fit_{backward}")
    for rank in ranks:
        for kind in ("applied", "recomputed"):
            assert (rank[kind]["verdict"], rank[kind]["fault"]) == ("fail", "formula"), rank[kind]["report"]
    assert ranks[0]["recomputed"]["message"] == ranks[1]["recomputed"]["message"]


@pytest.mark.parametrize("wrapped", ["bare", "ddp"])
def test_check_gradients_called_on_each_rank_checks_the_global_loss(lightning: dict[str, Any], wrapped: str) -> None:
    for rank in _both(lightning, "direct_correct"):
        said = rank[wrapped]
        assert said["verdict"] == "ok", said["report"]
        assert said["unchanged"]
        assert any(note.startswith("the loss calls collectives") for note in said["notes"])
    for backward in BACKWARDS[1:]:
        for rank in _both(lightning, f"direct_{backward}"):
            said = rank[wrapped]
            assert (said["verdict"], said["fault"]) == ("fail", "formula"), (backward, said["report"])
            assert said["unchanged"]


def test_check_gradients_checks_a_loss_with_collectives_on_ranks_that_hold_other_parameters_as_what_they_are(
    lightning: dict[str, Any],
) -> None:
    for rank in _both(lightning, "direct_split"):
        assert rank["verdict"] == "ok", rank["report"]
        assert "each rank's own part's, against the sum of the ranks' losses" in rank["report"]


def test_a_loss_that_raises_on_one_rank_after_its_collectives_ends_the_check_on_every_rank(
    lightning: dict[str, Any],
) -> None:
    rank0, rank1 = _both(lightning, "direct_raise")
    assert rank1["raised"] == "the gather's backward failed on purpose on rank 1"
    assert rank0["raised"] is None
    assert rank0["verdict"] == "inconclusive", rank0["report"]
    assert "the check raised on another rank" in rank0["report"]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("gather_loss_trainer")
    return run_launched("gather_loss_trainer_run.py", out, *BACKWARDS, timeout_s=540)[0]


def test_the_correct_gather_layer_fails_no_check_under_the_trainer_and_training_is_unchanged(
    trainer: dict[str, Any],
) -> None:
    for rank in _both(trainer, "correct"):
        assert rank["identical"]
        assert rank["applied"]["verdict"] == "ok", rank["applied"]["report"]
        assert rank["recomputed"]["verdict"] == "ok", rank["recomputed"]["report"]
        assert any(note.startswith("the loss calls collectives") for note in rank["recomputed"]["notes"])


@pytest.mark.parametrize("backward", BACKWARDS[1:])
def test_each_published_wrong_backward_fails_at_the_first_check_under_the_trainer(
    trainer: dict[str, Any], backward: str
) -> None:
    for rank in _both(trainer, backward):
        for kind in ("applied", "recomputed"):
            assert (rank[kind]["verdict"], rank[kind]["fault"]) == ("fail", "formula"), rank[kind]["report"]
