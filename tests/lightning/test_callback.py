"""GradWatch in real (tiny) Trainer.fit runs: schedule, logging, alerts, faults, state, validation."""

from __future__ import annotations

import copy
import csv
import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import (
    DropoutBatchNormNet,
    LitClassifier,
    LitSeedModel,
    assert_bit_identical,
    classification_batch,
    cross_entropy_loss,
    loader,
    recomputed_counts,
    seed_batch,
    snapshot,
    trainer,
)
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn

from gradwatch import CheckReport, GradientCheckError, GradientCheckWarning, GradientWatch, GradWatch
from gradwatch.engine.results.notes import NoteCode
from gradwatch.integrations.lightning.publishing import progress_status
from gradwatch.outputs.records import applied_scalars, update_scalars
from gradwatch.watch import watch as watch_module  # where the watch calls check_gradients

SCALAR_TAGS = {
    "gradwatch/rel_error_max",
    "gradwatch/rel_error_median",
    "gradwatch/rel_error_min",
    "gradwatch/descent_ratio",
    "gradwatch/failing_probes",
    "gradwatch/inconclusive_probes",
    "gradwatch/verdict",
    "gradwatch/check_seconds",
    "gradwatch/loss_evaluations",
    "gradwatch/forward_passes",
    "gradwatch/noise_median",
    "gradwatch/overhead",
    "gradwatch/overhead_percent",
    "gradwatch/first_checks_seconds",
    "gradwatch/rel_error_max_log10",
    "gradwatch/rel_error_median_log10",
    "gradwatch/rel_error_min_log10",
}


def _events(log_dir: str) -> EventAccumulator:
    accumulator = EventAccumulator(log_dir, size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


@pytest.mark.slow
def test_fit_writes_scalars_histograms_and_failure_text_readable_by_tensorboard(tmp_path: Path) -> None:
    watch = GradWatch(every_n_steps=2, max_overhead=None)
    logger = TensorBoardLogger(str(tmp_path), name="run", default_hp_metric=False)
    with pytest.warns(GradientCheckWarning, match=r"fc\.weight"):
        trainer(tmp_path, [watch], logger=logger, max_steps=4).fit(
            LitSeedModel(weight_scale=1.1), loader(seed_batch(), 4)
        )

    events = _events(logger.log_dir)
    tags = events.Tags()
    assert set(tags["scalars"]) >= SCALAR_TAGS
    assert [e.step for e in events.Scalars("gradwatch/verdict")] == [1, 2, 4]
    assert {e.value for e in events.Scalars("gradwatch/verdict")} == {2.0}  # fail
    assert [e.step for e in events.Histograms("gradwatch/rel_error_log10")] == [1, 2, 4]
    assert "gradwatch/failures/text_summary" in tags["tensors"]
    text = events.Tensors("gradwatch/failures/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| tensor | `net.fc.weight` |" in text
    assert "analytic" in text
    assert "numeric" in text
    # a fixed, small set of tags, whatever coordinates were sampled
    gradwatch_tags = [
        t for kind in ("scalars", "histograms", "tensors") for t in tags[kind] if t.startswith("gradwatch")
    ]
    applied = [t for t in gradwatch_tags if t.startswith("gradwatch/applied/")]  # the applied check at step 1
    assert watch.applied_reports[0].fault == "formula"  # named in words too, for the TEXT tab
    assert set(applied) == {
        *applied_scalars(watch.applied_reports[0]),
        "gradwatch/applied/failure/text_summary",
        "gradwatch/applied/fault_name/text_summary",
    }
    assert [e.step for e in events.Scalars("gradwatch/first_checks_steps")] == [2, 4]  # once a step's time is known
    update = [t for t in gradwatch_tags if t.startswith("gradwatch/update/")]  # the update check at step 1
    assert set(update) == set(update_scalars(watch.update_reports[0]))
    assert len(gradwatch_tags) == len(SCALAR_TAGS) + 3 + len(applied) + len(update)


@pytest.mark.slow
def test_healthy_run_logs_no_failure_text(tmp_path: Path) -> None:
    watch = GradWatch(every_n_steps=3, max_overhead=None)
    logger = TensorBoardLogger(str(tmp_path), name="run", default_hp_metric=False)
    trainer(tmp_path, [watch], logger=logger, max_steps=6).fit(LitClassifier(), loader(classification_batch()))
    events = _events(logger.log_dir)
    assert "gradwatch/failures/text_summary" not in events.Tags()["tensors"]
    assert [r.verdict for r in watch.recomputed_reports] == ["ok", "ok", "ok"]
    assert [e.value for e in events.Scalars("gradwatch/failing_probes")] == [0.0, 0.0, 0.0]
    ratios = [e.value for e in events.Scalars("gradwatch/descent_ratio")]
    assert all(abs(r - 1) < 1e-3 for r in ratios)


@pytest.mark.slow
def test_checks_run_on_optimizer_steps_under_gradient_accumulation(tmp_path: Path) -> None:
    watch = GradWatch(every_n_steps=3, max_overhead=None, first_check_step=1, param_probes=2, input_probes=0)
    model = LitClassifier()
    trainer(tmp_path, [watch], max_steps=10, accumulate_grad_batches=2).fit(model, loader(classification_batch(), 20))
    assert [r.step for r in watch.recomputed_reports] == [1, 3, 6, 9]
    verdicts = "\n".join(str(r) for r in watch.recomputed_reports)
    assert recomputed_counts(watch.counts) == {"checks": 4, "failed": 0, "skipped": 0, "postponed": 0}, verdicts


@pytest.mark.parametrize(
    ("previous", "step", "due"),
    [(0, 1, True), (1, 2, False), (4, 5, True), (5, 6, False), (8, 10, True), (10, 11, False)],
)
def test_schedule(previous: int, step: int, due: bool) -> None:
    assert GradWatch(every_n_steps=5, max_overhead=None, first_check_step=1).due(previous, step) is due


def test_without_first_check_only_the_interval_counts() -> None:
    watch = GradWatch(every_n_steps=5, max_overhead=None, first_check_step=None)
    assert not watch.due(0, 1)
    assert watch.due(4, 5)


@pytest.mark.slow
def test_probes_do_not_overwrite_the_runs_logged_metrics(tmp_path: Path) -> None:
    # every step is checked; without silencing, the last perturbed loss of the probes would be logged as train_loss
    model = LitClassifier()
    model.output = "dict"
    logger = CSVLogger(str(tmp_path), name="csv")
    run = trainer(
        tmp_path, [GradWatch(every_n_steps=1, max_overhead=None)], logger=logger, max_steps=5, log_every_n_steps=1
    )
    run.fit(model, loader(classification_batch()))
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        logged = [float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]
    assert logged == [model.real_losses[step] for step in sorted(model.real_losses)]
    assert "log" not in model.__dict__
    assert "log_dict" not in model.__dict__


@pytest.mark.slow
def test_other_loggers_get_the_scalars(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer(tmp_path, [GradWatch(every_n_steps=2, max_overhead=None)], logger=logger, max_steps=4).fit(
        LitClassifier(), loader(classification_batch())
    )
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("gradwatch/verdict")]
    assert [int(row["step"]) for row in rows] == [1, 2, 4]
    assert set(rows[0]) >= SCALAR_TAGS


@pytest.mark.slow
def test_no_logger_is_fine(tmp_path: Path) -> None:
    watch = GradWatch(every_n_steps=2, max_overhead=None)
    trainer(tmp_path, [watch], logger=False, max_steps=4).fit(LitClassifier(), loader(classification_batch()))
    assert len(watch.recomputed_reports) == 3


@pytest.mark.slow
def test_on_fail_raise(tmp_path: Path) -> None:
    with pytest.raises(GradientCheckError, match=r"(?s)gradient check failed at step 1\b.*\n.*fc\.weight"):
        trainer(tmp_path, [GradWatch(on_fail="raise", applied_every_n_steps=None)], max_steps=4).fit(
            LitSeedModel(weight_scale=1.1), loader(seed_batch(), 4)
        )


@pytest.mark.slow
def test_on_fail_stop_stops_the_trainer_cleanly(tmp_path: Path) -> None:
    run = trainer(tmp_path, [GradWatch(every_n_steps=1, max_overhead=None, on_fail="stop")], max_steps=8)
    with pytest.warns(GradientCheckWarning, match="stopping training"):
        run.fit(LitSeedModel(weight_scale=1.1), loader(seed_batch(), 8))
    assert run.global_step == 1
    assert run.state.finished


@pytest.mark.slow
def test_on_fail_callable_receives_the_report(tmp_path: Path) -> None:
    received: list[CheckReport] = []
    watch = GradWatch(every_n_steps=2, max_overhead=None, on_fail=received.append, applied_every_n_steps=None)
    trainer(tmp_path, [watch], max_steps=4).fit(LitSeedModel(weight_scale=1.1), loader(seed_batch(), 4))
    assert [r.step for r in received] == [1, 2, 4]
    assert all(r.verdict == "fail" and r in watch.recomputed_reports for r in received)


def _headline(message: str) -> str:
    """``"gradwatch: gradient check failed at step N"``, without the culprit or the counts that follow it."""
    found = re.match(r"gradwatch: gradient check failed at step \d+", message)
    assert found is not None, message
    return found.group(0)


@pytest.mark.slow
def test_warnings_are_rate_limited_and_each_failure_is_shown_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    watch = GradWatch(every_n_steps=1, max_overhead=None, param_probes=2, input_probes=0, applied_every_n_steps=None)
    with caplog.at_level(logging.INFO, logger="gradwatch"), pytest.warns(GradientCheckWarning) as warned:
        trainer(tmp_path, [watch], max_steps=9).fit(LitSeedModel(weight_scale=1.1), loader(seed_batch(), 9))
    assert watch.counts["failed"] == 9
    failures = [w for w in warned if "gradient check failed" in str(w.message)]
    assert [_headline(str(w.message)) for w in failures] == [
        f"gradwatch: gradient check failed at step {step}" for step in (1, 2, 4, 8)
    ]
    assert "fc.weight[" in str(failures[0].message)  # names tensor and index
    # a warned failure has no log record besides; those the backoff withholds get one INFO record each
    records = [r for r in caplog.records if "gradient check failed" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.INFO] * 5
    assert [_headline(r.getMessage()) for r in records] == [
        f"gradwatch: gradient check failed at step {step}" for step in (3, 5, 6, 7, 9)
    ]


@pytest.mark.slow
def test_not_verbose_logs_no_info_and_warns_only_for_failures(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    watch = GradWatch(
        every_n_steps=1, max_overhead=None, param_probes=2, input_probes=0, verbose=False, applied_every_n_steps=None
    )
    with caplog.at_level(logging.INFO, logger="gradwatch"), pytest.warns(GradientCheckWarning) as warned:
        trainer(tmp_path, [watch], max_steps=3).fit(LitSeedModel(weight_scale=1.1), loader(seed_batch(), 3))
    assert [r for r in caplog.records if r.name.startswith("gradwatch") and r.levelno >= logging.INFO] == []
    ours = [str(w.message) for w in warned if issubclass(w.category, GradientCheckWarning)]
    assert [_headline(message) for message in ours] == [
        f"gradwatch: gradient check failed at step {step}" for step in (1, 2)
    ]  # failing checks number 1 and 2; the 3rd is withheld


class _Flag(pl.Callback):
    """Sets attributes of the module just before GradWatch's check and restores them just after it, recording the
    model's state on both sides."""

    def __init__(self, **values: Any) -> None:
        self.values = values
        self.saved: dict[str, Any] = {}
        self.before: list[dict[str, Any]] = []
        self.after: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.saved = {name: getattr(pl_module, name) for name in self.values}
        for name, value in self.values.items():
            setattr(pl_module, name, value)
        self.before.append(snapshot(pl_module))

    def undo(self, pl_module: pl.LightningModule) -> None:
        self.after.append(snapshot(pl_module))
        for name, value in self.saved.items():
            setattr(pl_module, name, value)


class _Undo(pl.Callback):
    def __init__(self, flag: _Flag) -> None:
        self.flag = flag

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.flag.undo(pl_module)


@pytest.mark.slow
def test_probe_that_raises_never_stops_training_or_changes_state(tmp_path: Path) -> None:
    flag = _Flag(raise_in_step=True)
    watch = GradWatch(every_n_steps=2, max_overhead=None)
    run = trainer(tmp_path, [flag, watch, _Undo(flag)], max_steps=4)
    with pytest.warns(GradientCheckWarning, match="could not run and was skipped.*training_step failed on purpose"):
        run.fit(LitClassifier(), loader(classification_batch()))
    assert run.global_step == 4
    assert recomputed_counts(watch.counts) == {"checks": 0, "failed": 0, "skipped": 3, "postponed": 0}
    for before, after in zip(flag.before, flag.after, strict=True):
        assert_bit_identical(before, after)


@pytest.mark.slow
def test_probe_that_raises_with_on_fail_raise_propagates(tmp_path: Path) -> None:
    flag = _Flag(raise_in_step=True)
    with pytest.raises(RuntimeError, match="training_step failed on purpose"):
        trainer(tmp_path, [flag, GradWatch(on_fail="raise"), _Undo(flag)], max_steps=2).fit(
            LitClassifier(), loader(classification_batch())
        )


@pytest.mark.slow
def test_training_step_returning_none_skips_the_check(tmp_path: Path) -> None:
    flag = _Flag(output="none")
    watch = GradWatch(every_n_steps=1, max_overhead=None)
    trainer(tmp_path, [flag, watch, _Undo(flag)], max_steps=3).fit(LitClassifier(), loader(classification_batch()))
    assert watch.recomputed_reports == []
    assert watch.counts["skipped"] == 3


@pytest.mark.slow
def test_training_step_returning_a_dict(tmp_path: Path) -> None:
    model = LitClassifier()
    model.output = "dict"
    watch = GradWatch(every_n_steps=2, max_overhead=None)
    trainer(tmp_path, [watch], max_steps=2).fit(model, loader(classification_batch()))
    assert [r.verdict for r in watch.recomputed_reports] == ["ok", "ok"]


class _ManualModule(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = cross_entropy_loss(self.net, batch)
        self.manual_backward(loss)
        optimizer.step()
        return loss


@pytest.mark.slow
def test_manual_optimization_needs_a_loss_fn(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"manual optimization.*GradWatch\(loss_fn="):
        trainer(tmp_path, [GradWatch()], max_steps=2).fit(_ManualModule(), loader(classification_batch()))


@pytest.mark.slow
def test_manual_optimization_with_a_loss_fn(tmp_path: Path) -> None:
    watch = GradWatch(
        every_n_steps=2, max_overhead=None, loss_fn=lambda module, batch: cross_entropy_loss(module.net, batch)
    )
    trainer(tmp_path, [watch], max_steps=4).fit(_ManualModule(), loader(classification_batch()))
    assert [(r.step, r.verdict) for r in watch.recomputed_reports] == [(1, "ok"), (2, "ok"), (4, "ok")]


@pytest.mark.slow
def test_reports_are_bounded_oldest_first(tmp_path: Path) -> None:
    watch = GradWatch(every_n_steps=1, max_overhead=None, max_reports=2, param_probes=1, input_probes=0)
    trainer(tmp_path, [watch], max_steps=5).fit(LitClassifier(), loader(classification_batch()))
    assert [r.step for r in watch.recomputed_reports] == [4, 5]
    assert watch.counts["checks"] == 5


@pytest.mark.slow
def test_tensors_a_check_could_not_decide_are_probed_again_at_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    focus_given: list[tuple[str, ...]] = []
    real_check = watch_module.check_gradients

    def check_marking_a_kink(*args: Any, **kwargs: Any) -> CheckReport:
        focus_given.append(tuple(kwargs["focus"]))
        report = real_check(*args, **kwargs)
        # as if the first tensor probe had crossed a kink at this step
        first = next(i for i, p in enumerate(report.probes) if p.kind == "tensor")
        report.probes[first] = dataclasses.replace(report.probes[first], verdict="inconclusive", reason="kink")
        return report

    monkeypatch.setattr(watch_module, "check_gradients", check_marking_a_kink)
    watch = GradWatch(every_n_steps=1, max_overhead=None, tensor_probes=1)
    trainer(tmp_path, [watch], max_steps=3).fit(LitClassifier(), loader(classification_batch()))
    undecided = [r.undecided for r in watch.recomputed_reports]
    assert all(len(names) == 1 for names in undecided)
    assert focus_given == [(), undecided[0], undecided[1]]
    assert watch.state_dict()["focus"] == list(undecided[2])


@pytest.mark.slow
def test_state_dict_is_plain_and_survives_a_weights_only_round_trip(tmp_path: Path) -> None:
    watch = GradWatch(every_n_steps=1, max_overhead=None, param_probes=1, input_probes=0)
    with pytest.warns(GradientCheckWarning):
        trainer(tmp_path, [watch], max_steps=3).fit(LitSeedModel(weight_scale=1.1), loader(seed_batch(), 3))
    state = watch.state_dict()
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert loaded == state
    resumed = GradWatch(every_n_steps=1, max_overhead=None)
    resumed.load_state_dict(loaded)
    assert recomputed_counts(resumed.counts) == recomputed_counts(watch.counts)
    assert recomputed_counts(watch.counts) == {"checks": 3, "failed": 3, "skipped": 0, "postponed": 0}
    assert resumed.state_dict() == state
    GradWatch().load_state_dict({})  # a state from an older version: defaults


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 0}, r"`every_n_steps` must be None or an integer >= 1; got 0 \(int\)"),
        ({"every_n_steps": 2.5}, r"`every_n_steps` must be None or an integer >= 1; got 2.5 \(float\)"),
        ({"max_overhead": "some"}, "`max_overhead` must be 'auto', None or a number strictly between 0 and 1; got"),
        ({"first_check_step": 0}, "`first_check_step` must be None or an integer >= 1; got 0"),
        ({"on_fail": "explode"}, "`on_fail` must be one of 'warn', 'raise', 'stop' or a callable; got 'explode'"),
        ({"loss_fn": "mse"}, "`loss_fn` must be None or a callable; got 'mse'"),
        ({"param_probes": -1}, "`param_probes` must be an integer >= 0; got -1"),
        ({"input_probes": None}, r"`input_probes` must be an integer >= 0; got None \(NoneType\)"),
        ({"rtol": 1.5}, "`rtol` must be None or a number strictly between 0 and 1; got 1.5"),
        ({"seed": "a"}, "`seed` must be an integer >= 0; got 'a'"),
        ({"max_reports": 0}, "`max_reports` must be an integer >= 1; got 0"),
        ({"vectorize": None}, "`vectorize` must be True or False; got None"),
    ],
    ids=[
        "every_n_steps-zero",
        "every_n_steps-float",
        "max_overhead",
        "first_check_step",
        "on_fail",
        "loss_fn",
        "param_probes",
        "input_probes",
        "rtol",
        "seed",
        "max_reports",
        "vectorize",
    ],
)
def test_constructor_validates_every_argument(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GradWatch(**kwargs)


@pytest.mark.slow
def test_zero_interference_with_training(tmp_path: Path) -> None:
    # the same seeded run with and without gradwatch: identical parameters and buffers afterwards
    def run(callbacks: list[pl.Callback]) -> dict[str, torch.Tensor]:
        pl.seed_everything(0, verbose=False)
        model = LitClassifier(DropoutBatchNormNet())
        trainer(tmp_path, callbacks, max_steps=6).fit(model, loader(classification_batch()))
        return {name: value.detach().clone() for name, value in model.state_dict().items()}

    without = run([])
    with_checks = run([GradWatch(every_n_steps=2, max_overhead=None)])
    assert without.keys() == with_checks.keys()
    for name, value in without.items():
        assert torch.equal(value, with_checks[name]), name


@pytest.mark.slow
def test_progress_bar_shows_the_last_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the TQDM bar explicitly: Lightning picks the Rich bar when `rich` is installed, which draws differently
    bar = TQDMProgressBar()
    run = trainer(
        tmp_path,
        [GradWatch(every_n_steps=2, max_overhead=None, on_fail=lambda report: None), bar],
        max_steps=4,
        enable_progress_bar=True,
    )
    run.fit(LitSeedModel(weight_scale=1.1), loader(seed_batch(), 4))
    assert run.progress_bar_callback is not None
    assert run.progress_bar_callback.get_metrics(run, run.lightning_module)["gradwatch"] == "fail@4"
    drawn = capsys.readouterr()
    assert "gradwatch=fail@1" in drawn.out + drawn.err  # what the TQDM bar drew after the first check


def test_progress_status_keeps_earlier_failures_in_sight() -> None:
    def report(verdict: str, step: int) -> CheckReport:
        return CheckReport(step, verdict, [], 0.0, 1, 1, duration_s=0.0)  # type: ignore[arg-type]

    assert progress_status(report("ok", 500), failed_checks=0) == "ok@500"
    assert progress_status(report("fail", 1), failed_checks=1) == "fail@1"
    assert progress_status(report("inconclusive", 1000), failed_checks=2) == "inconclusive@1000 (2 failed)"


@pytest.mark.slow
def test_a_probe_slice_the_loss_refused_is_not_tried_again(tmp_path: Path) -> None:
    watch = GradWatch(
        every_n_steps=1, max_overhead=None, probe_batch_size=1
    )  # one sample, which the BatchNorm of LitClassifier refuses
    trainer(tmp_path, [watch], max_steps=3).fit(LitClassifier(), loader(classification_batch()))
    assert [r.samples for r in watch.recomputed_reports] == [4, 4, 4]
    assert [bool(r.noted(NoteCode.SLICE_REFUSED)) for r in watch.recomputed_reports] == [True, False, False]


class _BufferedNet(nn.Module):
    """Writes its logits in place into a fresh tensor, which vmap refuses only when a vectorised pass runs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, inputs: Tensor) -> Tensor:
        out = torch.zeros(inputs.shape[0], self.fc.out_features)
        out.copy_(self.fc(inputs))
        return out


@pytest.mark.slow
def test_loss_that_cannot_be_vectorised_is_not_tried_again(tmp_path: Path) -> None:
    watch = GradWatch(every_n_steps=1, max_overhead=None)
    trainer(tmp_path, [watch], max_steps=3).fit(LitClassifier(_BufferedNet()), loader(classification_batch()))
    assert [r.vectorized for r in watch.recomputed_reports] == [False, None, None]  # the first pass failed
    assert [r.verdict for r in watch.recomputed_reports] == ["ok", "ok", "ok"]
    # LitSeedModel's custom autograd.Function has no vmap rule, which the reference's graph shows: never tried
    watch = GradWatch(every_n_steps=1, max_overhead=None)
    trainer(tmp_path / "seed", [watch], max_steps=3).fit(LitSeedModel(), loader(seed_batch()))
    assert [r.vectorized for r in watch.recomputed_reports] == [None, None, None]
    assert [r.verdict for r in watch.recomputed_reports] == ["ok", "ok", "ok"]


@pytest.mark.slow
def test_training_step_is_vectorised(tmp_path: Path) -> None:
    watch = GradWatch(every_n_steps=1, max_overhead=None)
    trainer(tmp_path, [watch], max_steps=2).fit(LitClassifier(), loader(classification_batch()))
    assert [r.vectorized for r in watch.recomputed_reports] == [True, True]
    assert all(r.n_passes < r.n_forward for r in watch.recomputed_reports)


def test_the_budget_is_one_percent_whatever_the_cadence() -> None:
    assert (GradWatch().every_n_steps, GradWatch().max_overhead) == (500, 0.01)
    assert (GradWatch(every_n_steps=2).every_n_steps, GradWatch(every_n_steps=2).max_overhead) == (2, 0.01)
    assert GradientWatch(every_n_steps=2).max_overhead == 0.01  # the one default, the watch's
    assert GradWatch(every_n_steps=2, max_overhead=0.05).max_overhead == 0.05
    assert GradWatch(max_overhead=None).max_overhead is None
    # the rule of earlier versions, kept for those who ask for it: no budget for a cadence chosen by hand
    assert (
        GradWatch(max_overhead="auto").max_overhead,
        GradWatch(every_n_steps=2, max_overhead="auto").max_overhead,
    ) == (0.01, None)
    assert GradWatch().state_key == GradWatch(every_n_steps=500).state_key  # checkpoints of earlier versions load


def test_the_state_key_is_made_once_and_follows_what_it_is_made_of() -> None:
    # Lightning reads it at every hook it calls (six a step): it is kept, and made again when an option it names moves
    callback = GradWatch()
    assert callback.state_key is callback.state_key
    assert callback.state_key == "GradWatch{'every_n_steps': 500, 'seed': 0}"
    callback.watch.every_n_steps = 7
    assert callback.state_key == "GradWatch{'every_n_steps': 7, 'seed': 0}"
    callback.watch.loss_fn = _named_loss
    assert callback.state_key == "GradWatch{'every_n_steps': 7, 'seed': 0, 'loss_fn': '_named_loss'}"


def _named_loss(model: torch.nn.Module, batch: object) -> torch.Tensor:
    raise AssertionError("never called")


def test_the_options_are_read_back_from_the_watch_as_attributes() -> None:
    callback = GradWatch(every_n_steps=7, on_fail="raise", tensor_probes=2, precision="native")
    assert (callback.every_n_steps, callback.on_fail, callback.verbose) == (7, "raise", True)  # the watch's
    assert (callback.tensor_probes, callback.precision, callback.probe_batch_size) == (2, "native", 2)  # its settings
    assert callback.tensor_probes == callback.watch.settings.tensor_probes
    with pytest.raises(AttributeError, match="'GradWatch' object has no attribute 'tensor_probe'"):
        callback.tensor_probe  # noqa: B018
    copied = copy.deepcopy(callback)  # Lightning copies callbacks; the delegation must survive it
    assert (copied.every_n_steps, copied.tensor_probes) == (7, 2)
