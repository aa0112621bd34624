"""GradientWatch without a framework: in a plain PyTorch loop (checks on schedule, training bit for bit as without it,
a planted 2% bug caught at the first check with its module), under gradient accumulation, and what a loop lends it
(sinks, the collective decision, the agreement of ranks, a context, a skipped step), its state and its arguments."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from loop_models import MLP, assert_same_state, classification_batches, cross_entropy, plant_bug, state_of
from torch import nn

from gradwatch import CheckReport, GradientCheckError, GradientCheckWarning, GradientWatch
from gradwatch.engine.settings import ProbeSettings


def _train(watch: GradientWatch | None, steps: int = 6, bug: bool = False, accumulation: int = 1) -> dict[str, Any]:
    """A plain loop: ``steps`` optimizer steps of ``accumulation`` micro-batches each, the watch called once per
    optimizer step (the two lines a user adds)."""
    torch.manual_seed(0)
    model = MLP()
    if bug:
        plant_bug(model.layers[3])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = iter(classification_batches(steps * accumulation))
    for step in range(1, steps + 1):
        for _ in range(accumulation):
            batch = next(batches)
            (cross_entropy(model, batch) / accumulation).backward()
        optimizer.step()
        optimizer.zero_grad()
        if watch is not None:
            watch.maybe_check(model, batch, cross_entropy, step=step)
    return state_of(model, optimizer)


def test_a_plain_loop_checks_on_schedule_and_trains_as_without_the_watch() -> None:
    watch = GradientWatch(every_n_steps=2, max_overhead=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        watched = _train(watch)
    assert [(r.step, r.verdict) for r in watch.reports] == [(1, "ok"), (2, "ok"), (4, "ok"), (6, "ok")]
    assert watch.counts == {
        "checks": 4,
        "failed": 0,
        "skipped": 0,
        "postponed": 0,
        "applied_checks": 0,
        "applied_failed": 0,
        "update_checks": 0,
        "update_failed": 0,
    }
    assert_same_state(_train(None), watched)


def test_a_planted_bug_is_caught_at_the_first_check_with_its_module() -> None:
    watch = GradientWatch(every_n_steps=2, max_overhead=None, on_fail=lambda report: None)
    _train(watch, bug=True)
    first = watch.reports[0]
    assert (first.step, first.verdict) == (1, "fail")
    assert first.culprits[0] == "layers.3"
    assert watch.counts["failed"] == len(watch.reports)


def test_a_tensor_seen_failing_is_probed_again_at_the_next_check() -> None:
    """A wrong gradient found once is confirmed at every check, not only when the rotation comes round to it."""
    watch = GradientWatch(
        every_n_steps=1, max_overhead=None, tensor_probes=1, random_probes=0, param_probes=0, input_probes=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradientCheckWarning)
        _train(watch, steps=1, bug=True)
    first = watch.reports[0]
    assert first.verdict == "fail"
    assert "layers.3.weight" in first.failed_tensors
    assert watch.state_dict()["focus"][: len(first.undecided) + 1] == [*first.undecided, first.failed_tensors[0]]
    assert len(watch.state_dict()["focus"]) <= len(first.undecided) + 1  # at most tensor_probes of them
    healthy = GradientWatch(every_n_steps=1, max_overhead=None)
    _train(healthy, steps=2)
    assert all(not r.failed_tensors for r in healthy.reports)
    assert healthy.state_dict()["focus"] == list(healthy.reports[-1].undecided)


def test_under_gradient_accumulation_the_steps_are_optimizer_steps() -> None:
    watch = GradientWatch(every_n_steps=3, max_overhead=None)
    _train(watch, steps=6, accumulation=2)
    assert [(r.step, r.verdict, r.samples) for r in watch.reports] == [(1, "ok", 2), (3, "ok", 2), (6, "ok", 2)]


def test_a_second_call_at_the_same_step_is_ignored() -> None:
    model, batch = MLP(), classification_batches(1)[0]
    watch = GradientWatch(every_n_steps=1, max_overhead=None, loss_fn=cross_entropy)
    assert watch.maybe_check(model, batch, step=1) is not None
    assert watch.maybe_check(model, batch, step=1) is None
    assert watch.check(model, batch, step=1) is not None  # unconditional
    assert [r.step for r in watch.reports] == [1, 1]


class _Sink:
    def __init__(self) -> None:
        self.written: list[Any] = []
        self.flushes = 0

    def write(self, records: Any) -> None:
        self.written.append(records)

    def flush(self) -> None:
        self.flushes += 1


def test_what_a_loop_lends_the_watch() -> None:
    calls: list[str] = []

    def decide(wait: int) -> int:
        calls.append(f"decide {wait}")
        return 0

    def agree(report: CheckReport | None, error: Exception | None, step: int) -> CheckReport | None:
        calls.append(f"agree {report.verdict if report else None}")
        return report

    @contextlib.contextmanager
    def context(model: nn.Module) -> Iterator[None]:
        calls.append("enter")
        yield
        calls.append("exit")

    sink = _Sink()
    seen: list[CheckReport] = []
    watch = GradientWatch(
        every_n_steps=1, max_overhead=0.5, sinks=[sink], decide=decide, agree=agree, context=context,
        on_report=seen.append, on_fail=lambda report: None,
    )  # fmt: skip
    model, batch = MLP(), classification_batches(1)[0]
    plant_bug(model.layers[3])
    report = watch.maybe_check(model, batch, cross_entropy, step=1)
    assert report is not None
    assert calls == ["decide 0", "enter", "exit", "agree fail"]
    assert seen == [report]
    assert len(sink.written) == 1
    assert sink.flushes == 1  # a failure is flushed at once


def test_a_step_the_grad_scaler_skipped_moves_the_check_to_the_next() -> None:
    model, batch = MLP(), classification_batches(1)[0]
    watch = GradientWatch(every_n_steps=2, max_overhead=None, first_check_step=None, loss_fn=cross_entropy)
    assert watch.maybe_check(model, batch, step=1, skipped=lambda: pytest.fail("asked at a step not due")) is None
    assert watch.maybe_check(model, batch, step=2, skipped=True) is None
    report = watch.maybe_check(model, batch, step=3)
    assert report is not None
    assert report.step == 3
    assert watch.counts == {
        "checks": 1,
        "failed": 0,
        "skipped": 1,
        "postponed": 0,
        "applied_checks": 0,
        "applied_failed": 0,
        "update_checks": 0,
        "update_failed": 0,
    }


def test_on_fail_raise_stop_and_a_check_that_cannot_run() -> None:
    model, batch = MLP(), classification_batches(1)[0]
    plant_bug(model.layers[3])
    with pytest.raises(GradientCheckError, match=r"layers\.3"):
        GradientWatch(on_fail="raise").check(model, batch, cross_entropy, step=1)
    stopping = GradientWatch(on_fail="stop")
    with pytest.warns(GradientCheckWarning, match="stopping training"):
        stopping.check(model, batch, cross_entropy, step=1)
    assert stopping.should_stop

    def broken(model: nn.Module, batch: Any) -> torch.Tensor:
        raise RuntimeError("the loss failed on purpose")

    watch = GradientWatch()
    with pytest.warns(GradientCheckWarning, match="could not run and was skipped.*failed on purpose"):
        assert watch.check(model, batch, broken, step=1) is None
    assert watch.counts["skipped"] == 1


def test_ignore_patterns_that_match_nothing_warn_once_at_the_first_check() -> None:
    model, batch = MLP(), classification_batches(1)[0]
    watch = GradientWatch(every_n_steps=1, max_overhead=None, ignore=["layers.0.*", "encoder.*"])
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        watch.maybe_check(model, batch, cross_entropy, step=1)
        watch.maybe_check(model, batch, cross_entropy, step=2)
    assert len([w for w in warned if "encoder" in str(w.message)]) == 1
    assert all(not p.target.startswith("layers.0.") for r in watch.reports for p in r.probes)


def test_state_round_trips_and_older_states_load() -> None:
    watch = GradientWatch(every_n_steps=1, max_overhead=None)
    _train(watch, steps=3)
    resumed = GradientWatch(every_n_steps=1, max_overhead=None)
    resumed.load_state_dict(watch.state_dict())
    assert resumed.state_dict() == watch.state_dict()
    assert resumed.counts == watch.counts
    GradientWatch().load_state_dict({})


def test_not_verbose_logs_nothing_below_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    model, batch = MLP(), classification_batches(1)[0]
    plant_bug(model.layers[3])
    for verbose, expected in ((True, [1, 3]), (False, [])):
        caplog.clear()
        watch = GradientWatch(verbose=verbose, tensor_probes=1, param_probes=0, input_probes=0)
        with caplog.at_level(logging.INFO, logger="gradwatch"), warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            for step in (1, 2, 3):
                watch.check(model, batch, cross_entropy, step=step)
        # failing checks 1 and 2 warn; when verbose, INFO records say the notes once (step 1: not vectorised) and the
        # failure the backoff withholds (the 3rd)
        assert [int(r.args[0]) for r in caplog.records if r.name.startswith("gradwatch")] == expected
        assert len([w for w in warned if issubclass(w.category, GradientCheckWarning)]) == 2


def test_the_probe_options_are_one_settings_object() -> None:
    watch = GradientWatch(param_probes=3, ignore=["layers.0.*"], precision="native")
    assert watch.settings == ProbeSettings(
        param_probes=3, ignore=("layers.0.*",), precision="native", probe_batch_size=2
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 0}, r"`every_n_steps` must be None or an integer >= 1; got 0 \(int\)"),
        ({"param_probes": -1}, "`param_probes` must be an integer >= 0; got -1"),
        ({"verbose": "yes"}, "`verbose` must be True or False; got 'yes'"),
        ({"ignore": "layers.*"}, "`ignore` must be a list or tuple of pattern strings"),
    ],
    ids=["every_n_steps", "param_probes", "verbose", "ignore"],
)
def test_arguments_are_validated_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GradientWatch(**kwargs)


def test_a_loss_is_needed() -> None:
    with pytest.raises(ValueError, match="`loss_fn` must be given"):
        GradientWatch().maybe_check(MLP(), classification_batches(1)[0], step=1)


def test_the_state_keeps_the_keys_of_gradwatch_checkpoints() -> None:
    # GradWatch's checkpoints (state version 1) load into the watch it now adapts: the same keys, the same meaning
    assert set(GradientWatch().state_dict()) == {
        "version", "checks", "failed_checks", "skipped_checks", "focus", "last_step", "pending", "postponed_checks",
        "resume_at", "timed_steps", "check_seconds", "train_seconds", "last_check_seconds", "failure_warnings",
        "error_warnings", "applied_seconds",
        # the applied checks' keys, as GradWatch's checkpoints held them, and two added since
        "applied_checks", "applied_pending", "applied_resume_at", "applied_last_seconds", "applied_steps_seen",
        "applied_failed",
        "first_seconds",  # the first checks' time, apart from the steady share (read with a default: older states load)
        # the update checks' counts (gradwatch.watch.updates)
        "update_checks", "update_failed",
        # where a failing check's culprit search stopped at its cap, for the next to go on (read with defaults)
        "culprit_search_within", "culprit_search_candidates",
        # the applied checks' float64 back-off after running out of memory (gradwatch.watch.lessons, read with defaults)
        "applied_float64_misses", "applied_float64_native_left", "applied_float64_free_at_miss",
    }  # fmt: skip
