"""GradWatch in the training setups of real runs, each a tiny ``Trainer.fit`` on CPU: accumulation, mixed precision,
clipping, manual optimization, resume, short runs, odd modules and batches, zero interference and faults.

DDP runs in ``tests/test_ddp.py``; GPU-only setups (``16-mixed`` on CUDA) are skipped without CUDA.
"""

from __future__ import annotations

import csv
import math
import signal
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    DropoutBatchNormNet,
    LitClassifier,
    assert_bit_identical,
    classification_batch,
    cross_entropy_loss,
    loader,
    recomputed_counts,
    snapshot,
    trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from gradwatch import CheckReport, GradientCheckWarning, GradWatch

pytestmark = pytest.mark.slow

# -- modules -----------------------------------------------------------------------------------------------------------


class _Calls:
    """A log of calls kept in an object of the test's own class: gradwatch's sandbox puts back the model's lists, not
    what other objects hold, so the probes' calls stay visible here."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.local: list[bool] = []


class _Recording(LitClassifier):
    """Records, for every ``training_step`` call, the batch index, autocast state, logits dtype and train mode.

    Lightning calls ``training_step`` once per batch; the extra calls are gradwatch's probes.
    """

    def __init__(self, net: nn.Module | None = None, lr: float = 0.05) -> None:
        super().__init__(net, lr)
        self.log_of_calls = _Calls()

    @property
    def calls(self) -> list[dict[str, Any]]:
        return self.log_of_calls.calls

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Any:
        inputs, labels = batch
        logits = self.net(inputs)
        self.calls.append(
            {
                "batch_idx": batch_idx,
                "autocast": torch.is_autocast_enabled(inputs.device.type),
                "dtype": logits.dtype,
                "training": self.net.training,
            }
        )
        loss = F.cross_entropy(logits, labels)
        self.log("train_loss", loss)
        return loss

    def checked_batches(self) -> list[int]:
        counts: dict[int, int] = {}
        for call in self.calls:
            counts[call["batch_idx"]] = counts.get(call["batch_idx"], 0) + 1
        return sorted(index for index, count in counts.items() if count > 1)


class _Adam(LitClassifier):
    """Dropout + BatchNorm classifier trained with Adam (optimizer state to compare)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class _TwoOptimizers(LitClassifier):
    """Manual optimization with two optimizers (GAN-like: two nets, each stepped on its own loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.other = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))

    def losses(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        return cross_entropy_loss(self.net, batch), cross_entropy_loss(self.other, batch)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        for optimizer, loss in zip(self.optimizers(), self.losses(batch), strict=True):
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.net.parameters(), lr=0.05), torch.optim.Adam(self.other.parameters(), lr=1e-2)]


def _sum_of_losses(module: _TwoOptimizers, batch: tuple[Tensor, Tensor]) -> Tensor:
    first, second = module.losses(batch)
    return first + second


def _reports(watch: GradWatch) -> list[tuple[int, str]]:
    return [(r.step, r.verdict) for r in watch.recomputed_reports]


def _clean(report: CheckReport) -> bool:
    # an inconclusive descent probe (its stencil crossed ReLU kinks) measures noise: its ratio says nothing
    descent = report.descent
    measured = descent is not None and descent.conclusive
    return report.verdict == "ok" and not report.failures and (not measured or abs(report.descent_ratio - 1) < 1e-3)


# -- gradient accumulation ---------------------------------------------------------------------------------------------


def test_accumulation_checks_the_last_micro_batch_of_optimizer_steps_only(tmp_path: Path) -> None:
    model = _Recording()
    watch = GradWatch(
        every_n_steps=2,
        max_overhead=None,
        first_check_step=1,
        param_probes=2,
        input_probes=0,
        applied_every_n_steps=None,
    )
    trainer(tmp_path, [watch], max_steps=5, accumulate_grad_batches=4).fit(model, loader(classification_batch(), 20))
    assert [r.step for r in watch.recomputed_reports] == [1, 2, 4]  # optimizer steps, not the 20 micro-batches
    # the check runs after the optimizer step, on the window's last micro-batch: batches 3, 7 and 15
    assert model.checked_batches() == [3, 7, 15]
    assert recomputed_counts(watch.counts) == {"checks": 3, "failed": 0, "skipped": 0, "postponed": 0}


# -- mixed precision ---------------------------------------------------------------------------------------------------


def test_bf16_mixed_native_probes_run_outside_autocast_in_float32_and_are_as_clean(tmp_path: Path) -> None:
    verdicts = {}
    for precision in ("32-true", "bf16-mixed"):
        pl.seed_everything(0, verbose=False)  # the same model and dropout masks in both runs
        model = _Recording()
        watch = GradWatch(every_n_steps=2, max_overhead=None, precision="native")  # no float64 re-measurement
        trainer(tmp_path, [watch], max_steps=4, precision=precision).fit(model, loader(classification_batch()))
        verdicts[precision] = _reports(watch)
        assert all(_clean(r) for r in watch.recomputed_reports), "\n".join(str(r) for r in watch.recomputed_reports)
        _assert_probes_outside_autocast(
            model, torch.bfloat16 if precision == "bf16-mixed" else torch.float32, probe_dtype=torch.float32
        )
    assert verdicts["bf16-mixed"] == verdicts["32-true"] == [(1, "ok"), (2, "ok"), (4, "ok")]


class _Overflow(_Recording):
    """Scales its training loss by 1e8 at the given batches, so float16 gradients overflow and the GradScaler skips
    the optimizer step. The scaling is undone after the backward: the checks see the plain loss."""

    def __init__(self, overflow_batches: set[int]) -> None:
        super().__init__()
        self.overflow_batches = overflow_batches
        self.overflow = False

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.overflow = batch_idx in self.overflow_batches

    def on_after_backward(self) -> None:
        self.overflow = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 1e8 if self.overflow else loss


def _assert_probes_outside_autocast(
    model: _Recording, training_dtype: torch.dtype, probe_dtype: torch.dtype = torch.float64
) -> None:
    """The last check's probes ran without autocast, in ``probe_dtype`` (float64 with ``precision="auto"``)."""
    checked = model.checked_batches()
    # the last checked batch's calls: training's own, the reference gradient's (native), then the probes'
    probe_calls = [c for c in model.calls if c["batch_idx"] == checked[-1]][2:]
    assert probe_calls
    assert {c["autocast"] for c in probe_calls} == {False}
    assert {c["dtype"] for c in probe_calls} == {probe_dtype}
    training_calls = [c for c in model.calls if c["batch_idx"] not in checked]
    assert {c["dtype"] for c in training_calls} == {training_dtype}  # the training itself did run under autocast


class _Scales(pl.Callback):
    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def test_16_mixed_step_skipped_by_the_grad_scaler_is_a_skipped_check_and_the_check_moves_on(tmp_path: Path) -> None:
    # float16 autocast with a GradScaler, on CPU through the precision plugin (Trainer(precision="16-mixed") turns
    # into bf16-mixed on CPU); the optimizer steps 1 and 3 are skipped by the scaler
    scales = _Scales()
    watch = GradWatch(every_n_steps=3, max_overhead=None, first_check_step=1)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    model = _Overflow(overflow_batches={0, 2})
    trainer(tmp_path, [watch, scales], max_steps=6, plugins=[plugin]).fit(model, loader(classification_batch()))
    assert scales.scales[:4] == [32768.0, 32768.0, 16384.0, 16384.0]  # the scaler did skip steps 1 and 3
    # due at 1 and 3, both skipped by the scaler: the checks run at the next optimizer steps instead
    assert _reports(watch) == [(2, "ok"), (4, "ok"), (6, "ok")]
    assert recomputed_counts(watch.counts) == {"checks": 3, "failed": 0, "skipped": 2, "postponed": 0}
    _assert_probes_outside_autocast(model, torch.float16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_16_mixed_on_cuda(tmp_path: Path) -> None:
    model = _Overflow(overflow_batches={2})  # the scaler skips optimizer step 3
    watch = GradWatch(every_n_steps=1, max_overhead=None)
    run = trainer(tmp_path, [watch], max_steps=5, accelerator="gpu", precision="16-mixed")
    run.fit(model, loader(classification_batch()))
    assert 3 not in [r.step for r in watch.recomputed_reports]  # skipped by the scaler
    assert watch.counts["skipped"] == 1
    assert [r.step for r in watch.recomputed_reports] == [1, 2, 4, 5]
    assert all(_clean(r) for r in watch.recomputed_reports), "\n".join(str(r) for r in watch.recomputed_reports)
    _assert_probes_outside_autocast(model, torch.float16)


# -- gradient clipping -------------------------------------------------------------------------------------------------


class _GradNorms(pl.Callback):
    """The gradient norm before clipping (on_before_optimizer_step) and after it (at the batch end)."""

    def __init__(self) -> None:
        self.before: list[float] = []
        self.after: list[float] = []

    @staticmethod
    def _norm(module: nn.Module) -> float:
        return torch.linalg.vector_norm(
            torch.cat([p.grad.flatten() for p in module.parameters()]), dtype=torch.float64
        ).item()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.before.append(self._norm(pl_module))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.after.append(self._norm(pl_module))


def test_gradient_clipping_the_check_is_about_the_unclipped_gradient(tmp_path: Path) -> None:
    # lr=0 keeps the parameters where the training gradient was taken, so the check's gradient can be compared with it
    model = LitClassifier(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)), lr=0.0)
    norms = _GradNorms()
    watch = GradWatch(every_n_steps=1, max_overhead=None, probe_batch_size=None)  # the whole batch, as training
    trainer(tmp_path, [norms, watch], max_steps=3, gradient_clip_val=1e-4).fit(model, loader(classification_batch()))
    assert all(after <= 1.0001e-4 for after in norms.after)  # the training did clip
    assert all(_clean(r) for r in watch.recomputed_reports)
    for report, before in zip(watch.recomputed_reports, norms.before, strict=True):
        assert report.descent.analytic == pytest.approx(before, rel=1e-5)  # ‖g‖ before clipping, 1000x the clip


# -- manual optimization -----------------------------------------------------------------------------------------------


def test_manual_optimization_with_two_optimizers_needs_a_loss_fn(tmp_path: Path) -> None:
    model = _TwoOptimizers()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"_TwoOptimizers uses manual optimization.*GradWatch\(loss_fn="):
        trainer(tmp_path, [GradWatch()], max_steps=2).fit(model, loader(classification_batch()))
    assert_bit_identical(before, snapshot(model))  # refused at setup, before any step


def test_manual_optimization_with_two_optimizers_and_a_loss_fn(tmp_path: Path) -> None:
    def run(callbacks: list[pl.Callback]) -> _TwoOptimizers:
        pl.seed_everything(0, verbose=False)
        model = _TwoOptimizers()
        trainer(tmp_path, callbacks, max_steps=6).fit(model, loader(classification_batch()))
        return model

    watch = GradWatch(every_n_steps=2, max_overhead=None, loss_fn=_sum_of_losses)
    checked = run([watch])
    # each batch steps both optimizers, so global_step moves by 2 per batch
    assert _reports(watch) == [(2, "ok"), (4, "ok"), (6, "ok")]
    plain = run([])
    for (name, value), other in zip(checked.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(value, other), name


def test_non_scalar_loss_is_skipped_with_a_warning_naming_its_shape(tmp_path: Path) -> None:
    # in automatic optimization Lightning's own backward refuses a non-scalar loss before gradwatch sees it; a loss_fn
    # (manual optimization) can still return one
    watch = GradWatch(
        every_n_steps=1, max_overhead=None, loss_fn=lambda m, b: F.cross_entropy(m.net(b[0]), b[1], reduction="none")
    )
    run = trainer(tmp_path, [watch], max_steps=3)
    with pytest.warns(
        GradientCheckWarning, match=r"skipped \(ValueError: .*scalar tensor; got a tensor of shape \(32,\)"
    ):
        run.fit(_TwoOptimizers(), loader(classification_batch()))
    assert run.state.finished
    assert recomputed_counts(watch.counts) == {
        "checks": 0,
        "failed": 0,
        "skipped": 2,
        "postponed": 0,
    }  # steps 1 (first check) and 2, in batch one


def test_loss_of_shape_one_is_checked(tmp_path: Path) -> None:
    class ShapeOne(LitClassifier):
        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            return cross_entropy_loss(self.net, batch).reshape(1)

    watch = GradWatch(every_n_steps=2, max_overhead=None)
    trainer(tmp_path, [watch], max_steps=2).fit(ShapeOne(), loader(classification_batch()))
    assert _reports(watch) == [(1, "ok"), (2, "ok")]


class _SyncBatchNormSpy(_Recording):
    """The classifier with SyncBatchNorm (local statistics in a single process, so it trains on CPU); records whether
    the SyncBatchNorm's forward was swapped for the local one at each ``training_step`` call."""

    def __init__(self) -> None:
        super().__init__(nn.SyncBatchNorm.convert_sync_batchnorm(DropoutBatchNormNet()))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        norm = self.net.net[1]
        assert isinstance(norm, nn.SyncBatchNorm)
        local = "forward" in norm.__dict__
        loss = super().training_step(batch, batch_idx)  # may raise: one sample is refused in training mode
        self.log_of_calls.local.append(local)  # after the call, like ``calls``, so the two lists stay aligned
        return loss


def test_sync_batch_norm_uses_local_statistics_during_checks_only(tmp_path: Path) -> None:
    model = _SyncBatchNormSpy()
    watch = GradWatch(every_n_steps=2, max_overhead=None)
    trainer(tmp_path, [watch], max_steps=2).fit(model, loader(classification_batch()))
    assert _reports(watch) == [(1, "ok"), (2, "ok")]
    calls_per_batch = [c["batch_idx"] for c in model.calls]
    training = [calls_per_batch.index(index) for index in (0, 1)]  # the first call of each batch is the training one
    local = model.log_of_calls.local
    assert [local[i] for i in training] == [False, False]
    assert sum(local) == len(local) - 2  # every probe call ran with local statistics
    assert not any("forward" in m.__dict__ for m in model.modules())  # restored


# -- checkpoint and resume ---------------------------------------------------------------------------------------------


def test_resume_continues_the_schedule_and_the_counters(tmp_path: Path) -> None:
    def probed(watch: GradWatch) -> dict[int, list[tuple[str, str, Any]]]:
        return {r.step: [(p.kind, p.target, p.index) for p in r.probes] for r in watch.recomputed_reports}

    data = loader(classification_batch(), 4)
    uninterrupted = GradWatch(every_n_steps=2, max_overhead=None, param_probes=3)
    pl.seed_everything(0, verbose=False)
    trainer(tmp_path / "full", [uninterrupted], max_steps=8).fit(LitClassifier(), data)

    first = GradWatch(every_n_steps=2, max_overhead=None, param_probes=3)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    pl.seed_everything(0, verbose=False)
    trainer(tmp_path, [first, checkpoints], max_steps=4, enable_checkpointing=True).fit(LitClassifier(), data)
    path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    saved = torch.load(path, weights_only=True)  # the whole checkpoint, gradwatch's state included
    assert saved["callbacks"][first.state_key] == first.state_dict()

    resumed = GradWatch(every_n_steps=2, max_overhead=None, param_probes=3)
    trainer(tmp_path, [resumed], max_steps=8).fit(LitClassifier(), data, ckpt_path=str(path))
    assert [r.step for r in resumed.recomputed_reports] == [6, 8]  # no second "first check" at step 1 or 2
    assert recomputed_counts(resumed.counts) == recomputed_counts(uninterrupted.counts)
    assert recomputed_counts(uninterrupted.counts) == {"checks": 5, "failed": 0, "skipped": 0, "postponed": 0}
    # the rotation over tensors continues where it stopped: the same coordinates as the uninterrupted run
    assert probed(resumed) == {step: p for step, p in probed(uninterrupted).items() if step > 4}


# -- short runs, validation, epochs ------------------------------------------------------------------------------------


def test_fast_dev_run(tmp_path: Path) -> None:
    watch = GradWatch()
    run = trainer(tmp_path, [watch], fast_dev_run=2, logger=TensorBoardLogger(str(tmp_path)))
    run.fit(LitClassifier(), loader(classification_batch()))
    assert _reports(watch) == [(1, "ok")]


def test_max_steps_shorter_than_the_first_check(tmp_path: Path) -> None:
    watch = GradWatch(every_n_steps=10, max_overhead=None, first_check_step=5)
    run = trainer(tmp_path, [watch], max_steps=3)
    run.fit(LitClassifier(), loader(classification_batch()))
    assert run.global_step == 3
    assert watch.recomputed_reports == []
    assert recomputed_counts(watch.counts) == {"checks": 0, "failed": 0, "skipped": 0, "postponed": 0}


class _WithValidation(_Recording):
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", cross_entropy_loss(self.net, batch))


def test_validation_loops_and_epochs_of_limited_batches(tmp_path: Path) -> None:
    model = _WithValidation()
    watch = GradWatch(every_n_steps=2, max_overhead=None)
    run = trainer(
        tmp_path,
        [watch],
        max_steps=-1,
        max_epochs=3,
        limit_train_batches=3,
        limit_val_batches=2,
        val_check_interval=2,
        num_sanity_val_steps=2,
    )
    run.fit(model, loader(classification_batch()), loader(classification_batch(seed=5), 2))
    assert run.global_step == 9
    # the schedule counts optimizer steps across epochs; validation batches never trigger a check
    assert _reports(watch) == [(1, "ok"), (2, "ok"), (4, "ok"), (6, "ok"), (8, "ok")]
    assert all(call["training"] for call in model.calls)  # checks see the model in train mode, after validation too


# -- odd modules and batches -------------------------------------------------------------------------------------------


class _Unregistered(LitClassifier):
    """Its only layer sits in a plain list: it trains (the optimizer has it) but the module has no parameter."""

    def __init__(self) -> None:
        super().__init__(nn.Identity())
        self.layers = [nn.Linear(16, 4)]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return cross_entropy_loss(self.layers[0], batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.layers[0].parameters(), lr=0.1)


def test_module_without_trainable_parameters_skips_its_checks_with_one_warning(tmp_path: Path) -> None:
    watch = GradWatch(every_n_steps=1, max_overhead=None)
    run = trainer(tmp_path, [watch], max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(_Unregistered(), loader(classification_batch()))
    ours = [w for w in caught if issubclass(w.category, GradientCheckWarning)]
    assert len(ours) == 1
    assert "_Unregistered has no trainable floating-point parameter" in str(ours[0].message)
    assert run.global_step == 4
    assert recomputed_counts(watch.counts) == {"checks": 0, "failed": 0, "skipped": 4, "postponed": 0}


class _TokenClassifier(LitClassifier):
    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(8 * 6, 4)))


def test_batch_without_floating_tensors_has_parameter_probes_only(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (64, 6), generator=generator)
    labels = torch.randint(0, 4, (64,), generator=generator)
    watch = GradWatch(every_n_steps=2, max_overhead=None, input_probes=2)
    data = DataLoader(TensorDataset(tokens, labels), batch_size=16)
    trainer(tmp_path, [watch], max_steps=4).fit(_TokenClassifier(), data)
    assert _reports(watch) == [(1, "ok"), (2, "ok"), (4, "ok")]
    assert all(p.kind != "input" for r in watch.recomputed_reports for p in r.probes)


# -- zero interference -------------------------------------------------------------------------------------------------


def _seeded_run(tmp_path: Path, name: str, callbacks: list[pl.Callback], **kwargs: Any) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = _Adam(DropoutBatchNormNet())
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(96, 16, generator=generator), torch.randint(0, 4, (96,), generator=generator))
    logger = CSVLogger(str(tmp_path), name=name)
    run = trainer(tmp_path, callbacks, max_steps=8, logger=logger, log_every_n_steps=1, **kwargs)
    run.fit(model, DataLoader(data, batch_size=32, shuffle=True))  # 3 batches an epoch, shuffled
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        losses = [(int(row["step"]), row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]
    optimizer = run.optimizers[0].state_dict()["state"]
    return {"model": model.state_dict(), "optimizer": optimizer, "losses": losses}


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"precision": "bf16-mixed"}, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}],
    ids=["32-true", "bf16-mixed", "accumulation-clipping"],
)
def test_zero_interference_bit_identical_parameters_optimizer_state_and_logged_loss(
    tmp_path: Path, kwargs: dict[str, Any]
) -> None:
    plain = _seeded_run(tmp_path, "plain", [], **kwargs)
    watch = GradWatch(every_n_steps=1, max_overhead=None)
    checked = _seeded_run(tmp_path, "checked", [watch], **kwargs)
    assert len(watch.recomputed_reports) >= 4
    assert plain["losses"] == checked["losses"]
    assert len(plain["losses"]) >= 4
    for name, value in plain["model"].items():
        assert torch.equal(value, checked["model"][name]), name
    assert plain["optimizer"].keys() == checked["optimizer"].keys()
    for index, state in plain["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(value, checked["optimizer"][index][key]), (index, key)


# -- faults ------------------------------------------------------------------------------------------------------------


class _Faulty(LitClassifier):
    """Raises ``fault`` in ``training_step`` while it is set; its training loss is NaN at the batch ``nan_batch`` (so
    the parameters are NaN after that optimizer step, and the check at that step sees a NaN loss)."""

    def __init__(self, nan_batch: int | None = None) -> None:
        super().__init__()
        self.fault: type[BaseException] | None = None
        self.nan_batch = nan_batch
        self.nan = False

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.nan = batch_idx == self.nan_batch

    def on_after_backward(self) -> None:
        self.nan = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.fault is not None:
            raise self.fault("training_step failed on purpose")
        loss = cross_entropy_loss(self.net, batch)
        return loss * math.nan if self.nan else loss


class _AroundCheck(pl.Callback):
    """Placed before GradWatch: at optimizer step ``step``, sets ``fault`` and records the state the check starts from.
    ``undo`` (from a callback placed after GradWatch) records the state the check left and clears the fault."""

    def __init__(self, step: int, fault: type[BaseException] | None = None) -> None:
        self.step = step
        self.fault = fault
        self.before: dict[str, Any] | None = None
        self.after: dict[str, Any] | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            pl_module.fault = self.fault
            self.before = snapshot(pl_module)

    def undo(self, pl_module: pl.LightningModule) -> None:
        if self.before is not None and self.after is None:
            self.after = snapshot(pl_module)
            pl_module.fault = None


class _Undo(pl.Callback):
    def __init__(self, around: _AroundCheck) -> None:
        self.around = around

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.around.undo(pl_module)


def _verdict_steps(log_dir: str) -> dict[int, float]:
    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    events.Reload()
    if "gradwatch/verdict" not in events.Tags()["scalars"]:
        return {}
    return {e.step: e.value for e in events.Scalars("gradwatch/verdict")}


def _bits(state: dict[str, Any]) -> dict[str, Any]:
    """The snapshot with floating tensors viewed as integers, so NaNs compare bit for bit."""
    as_int = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}

    def bits(t: Tensor | None) -> Tensor | None:
        return t.view(as_int[t.dtype]) if t is not None and t.is_floating_point() else t

    return {**state, **{kind: {n: bits(t) for n, t in state[kind].items()} for kind in ("params", "buffers", "grads")}}


def test_exception_inside_a_probe_restores_everything_and_training_goes_on(tmp_path: Path) -> None:
    around = _AroundCheck(step=2, fault=RuntimeError)
    watch = GradWatch(every_n_steps=1, max_overhead=None)
    logger = TensorBoardLogger(str(tmp_path), name="tb", default_hp_metric=False)
    run = trainer(tmp_path, [around, watch, _Undo(around)], max_steps=4, logger=logger)
    with pytest.warns(GradientCheckWarning, match="at step 2 could not run and was skipped.*failed on purpose"):
        run.fit(_Faulty(), loader(classification_batch()))
    assert run.global_step == 4
    assert_bit_identical(around.before, around.after)
    assert _reports(watch) == [(1, "ok"), (3, "ok"), (4, "ok")]
    assert recomputed_counts(watch.counts) == {"checks": 3, "failed": 0, "skipped": 1, "postponed": 0}
    assert _verdict_steps(logger.log_dir) == {1: 0.0, 3: 0.0, 4: 0.0}


def test_keyboard_interrupt_during_a_probe_restores_everything_and_flushes_the_logs(tmp_path: Path) -> None:
    around = _AroundCheck(step=2, fault=KeyboardInterrupt)
    watch = GradWatch(every_n_steps=1, max_overhead=None)
    logger = TensorBoardLogger(str(tmp_path), name="tb", default_hp_metric=False)
    model = _Faulty()
    run = trainer(tmp_path, [around, watch, _Undo(around)], max_steps=4, logger=logger)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        # Lightning's graceful shutdown on KeyboardInterrupt: finalize the loggers, then sys.exit(1)
        with pytest.raises(SystemExit):
            run.fit(model, loader(classification_batch()))
    finally:
        signal.signal(signal.SIGINT, sigint)  # Lightning ignores SIGINT during its shutdown
    assert run.global_step == 2
    assert around.after is None  # the interrupt went straight through
    model.fault = None
    assert_bit_identical(around.before, snapshot(model))
    assert _reports(watch) == [(1, "ok")]
    assert _verdict_steps(logger.log_dir) == {1: 0.0}  # on disk


def test_nan_loss_at_a_checked_step_fails_the_check_restores_everything_and_logs_it_at_once(tmp_path: Path) -> None:
    logger = TensorBoardLogger(str(tmp_path), name="tb", default_hp_metric=False)
    on_disk: list[dict[int, float]] = []

    def alert(report: CheckReport) -> None:  # the event file as it is on disk when the alert fires
        on_disk.append(_verdict_steps(logger.log_dir))

    around = _AroundCheck(step=2)
    watch = GradWatch(every_n_steps=1, max_overhead=None, on_fail=alert)
    run = trainer(tmp_path, [around, watch, _Undo(around)], max_steps=4, logger=logger)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the NaN
        run.fit(_Faulty(nan_batch=1), loader(classification_batch()))
    assert run.state.finished
    assert run.global_step == 4  # training went on (with NaN parameters: the run's own problem)
    report = watch.recomputed_reports[1]
    assert (report.step, report.verdict) == (2, "fail")
    assert report.failures[0].reason == "nonfinite"
    assert_bit_identical(_bits(around.before), _bits(around.after))  # NaN parameters included, bit for bit
    assert on_disk[0] == {1: 0.0, 2: 2.0}  # flushed before the alert


def test_nan_loss_with_on_fail_stop_stops_cleanly(tmp_path: Path) -> None:
    watch = GradWatch(every_n_steps=1, max_overhead=None, on_fail="stop")
    run = trainer(tmp_path, [watch], max_steps=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(_Faulty(nan_batch=2), loader(classification_batch()))
    assert any("stopping training" in str(w.message) for w in caught)
    assert run.global_step == 3
    assert run.state.finished
    assert _reports(watch) == [(1, "ok"), (2, "ok"), (3, "fail")]
