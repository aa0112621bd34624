"""Real Lightning patterns, each a LightningModule as users write them, and a harness that fits one with and without
GradWatch and records everything the user can observe (used by ``tests/lightning/test_interference.py``).

Every pattern draws its data on the spot (a fixed seed) and exposes ``observe()``: its own lists, counters, caches and
metric states, copied.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import tempfile
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from gradwatch import CheckReport, GradWatch

FEATURES, CLASSES = 16, 4


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call, exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, {key: float(value) for key, value in metrics.items()}))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        return None


def classification_loader(batches: int = 6, size: int = 16) -> DataLoader:
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(batches * size, FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (batches * size,), generator=generator)
    return DataLoader(TensorDataset(inputs, labels), batch_size=size)


def token_loader(batches: int = 4, size: int = 4, length: int = 12, vocab: int = 64) -> DataLoader:
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (batches * size, length), generator=generator)
    labels = torch.randint(0, 3, (batches * size,), generator=generator)
    return DataLoader(TensorDataset(tokens, labels), batch_size=size)


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, CLASSES))


class Block(nn.Module):
    """The MLP with a forward of its own: dynamo compiles user code, not torch's own modules, so a compiled
    ``nn.Sequential`` would compile nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = _mlp()

    def forward(self, x: Tensor) -> Tensor:
        return self.layers[3](self.layers[2](torch.relu(self.layers[0](x))))


class Classifier(pl.LightningModule):
    """The base of the patterns: an MLP with dropout, Adam, and the loss logged."""

    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module = _mlp()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def step_loss(self, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        inputs, labels = batch
        logits = self(inputs)
        return F.cross_entropy(logits, labels), logits, labels

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, _, _ = self.step_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def observe(self) -> dict[str, Any]:
        return {}


class MetricAsObject(Classifier):
    """``self.log("train_acc", self.train_acc)``: the metric object is logged, Lightning computes it at epoch end."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, logits, labels = self.step_loss(batch)
        self.train_acc(logits.argmax(-1), labels)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("train_loss", loss)
        return loss

    def observe(self) -> dict[str, Any]:
        return {"state": _metric_state(self.train_acc)}


class MetricAsValue(Classifier):
    """``self.log("train_acc", self.train_acc(preds, labels))`` and ``compute()`` at epoch end."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
        self.epoch_accuracy: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, logits, labels = self.step_loss(batch)
        self.log("train_acc_step", self.train_acc(logits.argmax(-1), labels))
        return loss

    def on_train_epoch_end(self) -> None:
        self.epoch_accuracy.append(float(self.train_acc.compute()))
        self.train_acc.reset()

    def observe(self) -> dict[str, Any]:
        return {"state": _metric_state(self.train_acc), "epochs": list(self.epoch_accuracy)}


class MetricCollectionPattern(Classifier):
    """A ``MetricCollection`` updated in ``training_step`` and logged with ``log_dict``."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.metrics = torchmetrics.MetricCollection(
            {
                "acc": torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES),
                "f1": torchmetrics.F1Score(task="multiclass", num_classes=CLASSES, average="macro"),
            },
            prefix="train_",
        )

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, logits, labels = self.step_loss(batch)
        self.log_dict(self.metrics(logits.argmax(-1), labels), on_step=True, on_epoch=True)
        return loss

    def observe(self) -> dict[str, Any]:
        return {name: _metric_state(metric) for name, metric in self.metrics.items()}


class EpochAggregation(Classifier):
    """The Lightning 2.x pattern: losses kept in ``training_step``, stacked and averaged at the epoch's end."""

    def __init__(self) -> None:
        super().__init__()
        self.training_step_outputs: list[Tensor] = []
        self.epoch_means: list[Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, _, _ = self.step_loss(batch)
        self.training_step_outputs.append(loss.detach())
        return loss

    def on_train_epoch_end(self) -> None:
        mean = torch.stack(self.training_step_outputs).mean()
        self.epoch_means.append(mean)
        self.log("epoch_loss", mean)
        self.training_step_outputs.clear()

    def observe(self) -> dict[str, Any]:
        return {"outputs": list(self.training_step_outputs), "means": list(self.epoch_means)}


class CountersAndCaches(Classifier):
    """Counters, a cached tensor, a dict cache and a bounded history on ``self``."""

    def __init__(self) -> None:
        super().__init__()
        self.n_seen = 0
        self.calls = torch.zeros(())  # a tensor counter, updated in place
        self.last_logits: Tensor | None = None
        self.cache: dict[int, Tensor] = {}
        self.history: collections.deque[float] = collections.deque(maxlen=3)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, logits, _ = self.step_loss(batch)
        self.n_seen += len(batch[0])
        self.calls += 1
        self.last_logits = logits.detach()
        self.cache[batch_idx % 2] = loss.detach()
        self.history.append(float(loss))
        self.log("seen", float(self.n_seen))
        return loss

    def observe(self) -> dict[str, Any]:
        return {
            "n_seen": self.n_seen,
            "calls": self.calls.clone(),
            "last_logits": self.last_logits,
            "cache": dict(self.cache),
            "history": list(self.history),
        }


class MetricsInADict(Classifier):
    """Metrics kept in a plain dict (not registered as submodules, a common slip), updated in ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.tracked = {"acc": torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)}

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, logits, labels = self.step_loss(batch)
        self.tracked["acc"].update(logits.argmax(-1), labels)
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("acc", self.tracked["acc"].compute())

    def observe(self) -> dict[str, Any]:
        return {"state": _metric_state(self.tracked["acc"])}


class DirectLogging(Classifier):
    """``training_step`` writing to its logger itself, bypassing ``self.log``."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, _, _ = self.step_loss(batch)
        assert self.logger is not None
        self.logger.log_metrics({"direct_loss": float(loss)}, step=self.global_step)
        return loss


class RaisesDuringChecks(CountersAndCaches):
    """Counts and caches like :class:`CountersAndCaches`, then raises when called a second time for one batch (as a
    check calls it, and training never does): a check that fails half-way, whatever fallback it tries (grad mode,
    another probe slice, point by point). The calls are counted outside the module, where no check puts them back."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        key = (id(self), self.trainer.current_epoch, batch_idx)
        _CALLS_PER_BATCH[key] = _CALLS_PER_BATCH.get(key, 0) + 1
        if _CALLS_PER_BATCH[key] > 1:
            raise RuntimeError("training_step called twice for one batch")
        return loss


_CALLS_PER_BATCH: dict[tuple[int, int, int], int] = {}


class CompiledSubmodule(Classifier):
    """``self.net = torch.compile(net)``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.compile(Block())


class CompiledInPlace(Classifier):
    """``net.compile()``: the module compiled in place."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Block()
        self.net.compile()


class Unlogged(Classifier):
    """The classifier without ``self.log``: dynamo (torch 2.13) cannot trace Lightning's ``log`` when the whole
    module is compiled with ``Trainer.fit(torch.compile(module))``."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.step_loss(batch)[0]


class Checkpointed(Classifier):
    """Activation checkpointing (non-reentrant) of a block with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(FEATURES, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 32))
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=False))


class TinyLlama(pl.LightningModule):
    """``LlamaForCausalLM`` from a tiny config (random init), its own loss."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
        )
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, _ = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def observe(self) -> dict[str, Any]:
        return {}


class TinyBert(TinyLlama):
    """``BertForSequenceClassification`` from a tiny config (random init, dropout on), its own loss."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
            num_labels=3,
        )
        self.model = BertForSequenceClassification(config)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, labels = batch
        loss = self.model(input_ids=tokens, labels=labels).loss
        self.log("train_loss", loss)
        return loss


def _metric_state(metric: nn.Module) -> dict[str, Any]:
    state = {name: copy.deepcopy(getattr(metric, name)) for name in metric._defaults}  # type: ignore[attr-defined]
    state["_update_count"] = metric._update_count  # type: ignore[attr-defined]
    return state


@dataclasses.dataclass(frozen=True)
class Pattern:
    name: str
    module: Callable[[], pl.LightningModule]
    loader: Callable[[], DataLoader] = classification_loader
    needs: str | None = None
    """A package the pattern needs (the test skips without it)."""
    compiled: bool = False
    fit_compiled: bool = False
    """``Trainer.fit(torch.compile(module))``: Lightning compiles the whole module."""
    max_epochs: int | None = None


PATTERNS = [
    Pattern("torchmetrics logged as object", MetricAsObject, needs="torchmetrics", max_epochs=2),
    Pattern("torchmetrics logged as value", MetricAsValue, needs="torchmetrics", max_epochs=2),
    Pattern("MetricCollection with log_dict", MetricCollectionPattern, needs="torchmetrics", max_epochs=2),
    Pattern("metrics in a plain dict", MetricsInADict, needs="torchmetrics", max_epochs=2),
    Pattern("training_step_outputs aggregation", EpochAggregation, max_epochs=3),
    Pattern("counters and caches", CountersAndCaches),
    Pattern("logger called in training_step", DirectLogging),
    Pattern("torch.compile on a submodule", CompiledSubmodule, compiled=True),
    Pattern("module.compile() in place", CompiledInPlace, compiled=True),
    Pattern("torch.compile on the whole model", Unlogged, compiled=True, fit_compiled=True),
    Pattern("gradient checkpointing with dropout", Checkpointed),
    Pattern("Hugging Face Llama (tiny config)", TinyLlama, token_loader, needs="transformers"),
    Pattern("Hugging Face BERT (tiny config)", TinyBert, token_loader, needs="transformers"),
]


@dataclasses.dataclass
class Observed:
    """Everything a user can observe after a fit."""

    params: dict[str, Tensor]
    optimizer: dict[str, Any]
    logged: list[tuple[int | None, dict[str, float]]]
    callback_metrics: dict[str, Tensor]
    progress_bar: dict[str, Any]
    own: dict[str, Any]
    graphs: int
    reports: list[CheckReport]


def fit(pattern: Pattern, with_watch: bool, **watch_options: Any) -> Observed:
    """Fit the pattern's module from seed 0 (with GradWatch checking every other step, if asked)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    pl.seed_everything(0, verbose=False)
    module = pattern.module()
    logger = RecordingLogger()
    watch = GradWatch(**{"every_n_steps": 2, "max_overhead": None, **watch_options}) if with_watch else None
    trainer = pl.Trainer(
        default_root_dir=tempfile.mkdtemp(prefix="gradwatch-pattern-"),  # what loggers write, outside the tree
        accelerator="cpu",
        devices=1,
        max_steps=-1 if pattern.max_epochs else 6,
        max_epochs=pattern.max_epochs or -1,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[watch] if watch is not None else [],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(torch.compile(module) if pattern.fit_compiled else module, pattern.loader())  # type: ignore[arg-type]
    logged = [
        (step, {k: v for k, v in values.items() if not k.startswith("gradwatch/")}) for step, values in logger.records
    ]
    return Observed(
        params={name: value.detach().clone() for name, value in module.state_dict().items()},
        optimizer=copy.deepcopy(trainer.optimizers[0].state_dict()),
        logged=[(step, values) for step, values in logged if values],
        # gradwatch's own scalars are its output (monitorable by EarlyStopping); everything else must be as without it
        callback_metrics={k: v.clone() for k, v in trainer.callback_metrics.items() if not k.startswith("gradwatch/")},
        progress_bar={k: v for k, v in trainer.progress_bar_metrics.items() if k != "gradwatch"},
        own=module.observe(),  # type: ignore[operator]
        graphs=int(counters["stats"]["unique_graphs"]),
        reports=watch.recomputed_reports if watch is not None else [],
    )


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two observations differ, bit for bit (NaNs equal where both are NaN)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        same = (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
            and torch.equal(a.isnan(), b.isnan())
        )
        return [] if same else [path or "tensor"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path} keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for key in a for d in differences(a[key], b[key], f"{path}.{key}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def compare(without: Observed, with_checks: Observed) -> list[str]:
    """Everything observable that differs between the two fits."""
    found = []
    for field in ("params", "optimizer", "logged", "callback_metrics", "progress_bar", "own", "graphs"):
        found += differences(getattr(without, field), getattr(with_checks, field), field)
    return found


def main() -> None:
    """Print the matrix as a table: pattern, identical?, checks, verdicts, vectorised checks, graphs compiled."""
    print(
        "| pattern | identical with and without GradWatch | checks | verdicts | vectorised checks | compiled graphs |"
    )
    print("|---|---|---|---|---|---|")
    for pattern in PATTERNS:
        without, with_checks = fit(pattern, with_watch=False), fit(pattern, with_watch=True)
        found = compare(without, with_checks)
        verdicts = collections.Counter(report.verdict for report in with_checks.reports)
        vectorised = sum(report.vectorized is True for report in with_checks.reports)
        print(
            f"| {pattern.name} | {'yes' if not found else 'NO: ' + '; '.join(found[:3])} | {len(with_checks.reports)} "
            f"| {', '.join(f'{n} {v}' for v, n in sorted(verdicts.items()))} | {vectorised} "
            f"| {without.graphs} / {with_checks.graphs} |"
        )


if __name__ == "__main__":
    main()
