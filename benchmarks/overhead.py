"""What gradwatch costs a real training run: wall-time ratios, one check against its lower bound, peak memory.

Two small real models on synthetic data, trained with Lightning on CPU: a CNN on CIFAR-shaped images (batch 128) and a
GPT-style transformer language model (batch 32 x 64 tokens). For each setting, runs without (A) and with (B) GradWatch
alternate in the same process (A B A B ...), so that machine drift cancels; the table gives the ratio of their median
training times next to Cockpit's published overhead of its cheapest configuration.

``--scale`` instead trains a GPT of about 120M parameters for a few steps and reports one check's time and peak memory
against the training step (no Lightning, the engine with GradWatch's default settings).

On a GPU, ``--accelerator gpu --precision 16-mixed`` (or ``bf16-mixed``) runs the same table there; the probes
themselves always run outside autocast.

Run: ``python benchmarks/overhead.py`` (about 10 minutes on 2 CPU cores), ``python benchmarks/overhead.py --scale``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import inspect
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from resident import PeakResident
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from gradwatch import GradientWatch, GradWatch, check_gradients

COCKPIT = {1: 1.51, 4: 1.17, 16: 1.04, 64: 1.02}
"""Cockpit's cheapest configuration ("economy"), overhead factor by tracking interval (its paper, CIFAR-10 CNN, GPU)."""


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(64 * 16, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


class GPT(nn.Module):
    """A decoder-only transformer language model (pre-norm blocks, causal attention, tied output embedding)."""

    def __init__(self, vocab: int, width: int, depth: int, heads: int, context: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.position = nn.Parameter(0.02 * torch.randn(context, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length)
        h = self.blocks(self.embedding(tokens) + self.position[:length], mask=mask, is_causal=True)
        return self.norm(h) @ self.embedding.weight.T


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm and a shortcut."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 as used on CIFAR (3x3 stem, no max-pool): 11M parameters, 20 BatchNorm layers."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        widths = [(64, 1), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1)]
        blocks, inputs = [], 64
        for outputs, stride in widths:
            blocks.append(BasicBlock(inputs, outputs, stride))
            inputs = outputs
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(512, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


class Module(pl.LightningModule):
    def __init__(self, net: nn.Module, loss: Callable[[nn.Module, Any], Tensor]) -> None:
        super().__init__()
        self.net = net
        self.loss = loss

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.loss(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _image_loss(net: nn.Module, batch: Any) -> Tensor:
    return F.cross_entropy(net(batch[0]), batch[1])


def _lm_loss(net: nn.Module, batch: Any) -> Tensor:
    tokens = batch[0]
    logits = net(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _cnn_setup(steps: int) -> tuple[Callable[[], nn.Module], Callable[[nn.Module, Any], Tensor], DataLoader]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * 128, 3, 32, 32, generator=g), torch.randint(0, 10, (steps * 128,)))
    return CNN, _image_loss, DataLoader(data, batch_size=128)


def _gpt_setup(steps: int) -> tuple[Callable[[], nn.Module], Callable[[nn.Module, Any], Tensor], DataLoader]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, 512, (steps * 32, 65), generator=g))
    return (lambda: GPT(512, 128, 2, 4, 64)), _lm_loss, DataLoader(data, batch_size=32)


def _resnet_setup(steps: int) -> tuple[Callable[[], nn.Module], Callable[[nn.Module, Any], Tensor], DataLoader]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * 8, 3, 32, 32, generator=g), torch.randint(0, 10, (steps * 8,)))
    return ResNet18, _image_loss, DataLoader(data, batch_size=8)


def _llama_loss(net: nn.Module, batch: Any) -> Tensor:
    tokens = batch[0]
    return net(input_ids=tokens, labels=tokens).loss


def _llama_setup(steps: int) -> tuple[Callable[[], nn.Module], Callable[[nn.Module, Any], Tensor], DataLoader]:
    """A small ``LlamaForCausalLM`` from ``transformers`` (random init from a config), batch 8 x 64 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, 1024, (steps * 8, 64), generator=g))
    return (lambda: LlamaForCausalLM(config)), _llama_loss, DataLoader(data, batch_size=8)


class MLP(nn.Module):
    """A small MLP classifier (32 features, two hidden layers of 256): a training step of a few milliseconds, so that
    10,000-step runs fit a benchmark session."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


def _mlp_setup(steps: int) -> tuple[Callable[[], nn.Module], Callable[[nn.Module, Any], Tensor], DataLoader]:
    """The MLP on 256 batches of 64 synthetic samples, repeated for as many epochs as the run's steps take."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256 * 64, 32, generator=g), torch.randint(0, 10, (256 * 64,), generator=g))
    return MLP, _image_loss, DataLoader(data, batch_size=64)


REALISTIC = {
    "CNN, CIFAR-shaped, batch 128": (_cnn_setup, 256),
    "GPT LM, 32 x 64 tokens": (_gpt_setup, 256),
    "ResNet-18 (CIFAR, BatchNorm), batch 8": (_resnet_setup, 1500),
    "Llama (transformers, 4 layers, width 128), 8 x 64 tokens": (_llama_setup, 1000),
    "CNN, CIFAR-shaped, batch 128, long enough for an applied check": (_cnn_setup, 3000),
}
"""The models of the default-settings table, with the run length (steps) each is trained for: long enough that the
first check, which is always made, is one of several budgeted ones."""

SHORT = {
    "CNN, CIFAR-shaped, batch 128": (_cnn_setup, 600),
    "GPT LM, 32 x 64 tokens": (_gpt_setup, 600),
}
"""A 600-step fine-tune at the defaults (``--short``): both kinds of check at step 1, then the 1% budget."""

LONG = [
    ("MLP (32-256-256-10), batch 64", _mlp_setup, 10_000, 3),
    ("GPT LM, 32 x 64 tokens", _gpt_setup, 1000, 3),
    ("CNN, CIFAR-shaped, batch 128", _cnn_setup, 600, 1),
    ("GPT LM, 32 x 64 tokens", _gpt_setup, 600, 1),
]
"""The rows of ``--long``: runs of 10,000, 1,000 and 600 steps at the defaults, with the runs without a watch each is
interleaved with (the 600-step rows one: their wall-time ratio moves too much on a shared machine to mean much; the
10,000-step row on a small MLP, whose steps are short enough for 10,000 of them to fit a benchmark session)."""


class _Timer(pl.Callback):
    """Training time of one fit, from its first to its last training batch (with the GPU's queue drained)."""

    def __init__(self) -> None:
        self.started = 0.0
        self.seconds = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _synchronize()
        self.started = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _synchronize()
        self.seconds = time.perf_counter() - self.started


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


RUN = {"accelerator": "cpu", "precision": "32-true"}
"""The Trainer's accelerator and precision for every run of the table (set from the command line)."""


def _fit(
    build: Callable[[], nn.Module],
    loss: Callable,
    loader: DataLoader,
    steps: int,
    watch: GradWatch | None,
    memory: bool = False,
) -> tuple[float, int]:
    """One training run of ``steps`` steps: its training time and, with ``memory``, the process's peak memory (the
    GPU's, on a GPU). Timed runs leave memory out: sampling RSS takes the interpreter every 2 ms."""
    torch.manual_seed(0)
    timer = _Timer()
    callbacks: list[pl.Callback] = [timer] + ([watch] if watch is not None else [])
    trainer = pl.Trainer(
        accelerator=RUN["accelerator"],
        precision=RUN["precision"],  # type: ignore[arg-type]
        max_steps=steps,
        max_epochs=-1,  # a loader shorter than the run (the MLP's) is repeated
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    gpu = RUN["accelerator"] == "gpu"
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    with PeakResident() if memory and not gpu else contextlib.nullcontext() as sampler:
        trainer.fit(Module(build(), loss), loader)
    if not memory:
        return timer.seconds, 0
    return timer.seconds, torch.cuda.max_memory_allocated() if gpu else sampler.peak


def _unit_costs(build: Callable[[], nn.Module], loss: Callable, loader: DataLoader, report: Any) -> tuple[float, float]:
    """The measured cost of one forward (no grad, in the precision the probes ran in) and of one forward and backward
    (native, as the reference gradient) on the probe batch: a check's lower bound is its forward and backward counts
    times these."""
    device = torch.device("cuda" if RUN["accelerator"] == "gpu" else "cpu")
    net = build().to(device)
    batch = next(iter(loader))
    sample = [t[: report.samples].to(device) for t in batch]
    probe_net, probe_sample = net, sample
    if report.precision == "float64":
        probe_net = build().double().to(device)
        probe_sample = [t.double() if t.is_floating_point() else t for t in sample]

    def timed(fn: Callable[[], object], repeats: int = 10, blocks: int = 7) -> float:
        """The median over ``blocks`` blocks of the mean time of ``repeats`` calls: a block that a busy moment of the
        machine slowed or sped up does not move the bound."""
        fn()
        means = []
        for _ in range(blocks):
            _synchronize()
            started = time.perf_counter()
            for _ in range(repeats):
                fn()
            _synchronize()
            means.append((time.perf_counter() - started) / repeats)
        return statistics.median(means)

    def forward() -> None:
        with torch.no_grad():
            loss(probe_net, probe_sample)

    def forward_backward() -> None:
        torch.autograd.grad(loss(net, sample), list(net.parameters()))

    return timed(forward), timed(forward_backward)


def overhead_table(repeats: int, steps: int) -> None:
    print(
        "| model | setting | checks per run | time with / without (median of",
        repeats,
        "pairs) | 1 + gradwatch's own time / training time | Cockpit |",
    )
    print("|---|---|---|---|---|---|")
    bounds = []
    per_run: dict[str, list[float]] = {}  # by model: each every-1 run's median ratio of check time to bound
    for name, setup in (("CNN, CIFAR-shaped, batch 128", _cnn_setup), ("GPT LM, 32 x 64 tokens", _gpt_setup)):
        build, loss, loader = setup(steps)
        settings: list[tuple[str, dict[str, Any]]] = [("default (every 500, 1% budget)", {})]
        every = {"first_check_step": None, "max_overhead": None}  # on schedule, at any cost
        settings += [(f"every {n}", {"every_n_steps": n, **every}) for n in (1, 4, 16, 64, 256)]
        settings += [("budget max_overhead=0.01, every 1", {"every_n_steps": 1, "max_overhead": 0.01})]
        memory = {}
        for label, options in settings:
            ratios = []
            own = []
            checks = 0
            for _ in range(repeats):
                without, _ = _fit(build, loss, loader, steps, None)
                watch = GradWatch(**options)
                with_watch, _ = _fit(build, loss, loader, steps, watch)
                ratios.append(with_watch / without)
                own.append(1 + watch.overhead)  # the callback's own clock: check time over the time between batches
                checks = len(watch.reports)
                if label == "every 1":
                    forward, forward_backward = _unit_costs(build, loss, loader, watch.reports[-1])
                    run_ratios = []
                    for report in watch.reports:
                        bound = (report.n_forward - report.n_backward) * forward + report.n_backward * forward_backward
                        bounds.append((name, report, bound))
                        run_ratios.append(report.duration_s / bound)
                    per_run.setdefault(name, []).append(statistics.median(run_ratios))
            if label == "every 1":  # one more pair, untimed, for peak memory
                memory["without"] = _fit(build, loss, loader, steps, None, memory=True)[1]
                memory["with"] = _fit(build, loss, loader, steps, GradWatch(**options), memory=True)[1]
            interval = options.get("every_n_steps")
            cockpit = f"{COCKPIT[interval]:.2f}x" if interval in COCKPIT and options.get("max_overhead") is None else ""
            print(
                f"| {name} | {label} | {checks} | {statistics.median(ratios):.3f}x | "
                f"{statistics.median(own):.3f}x | {cockpit} |"
            )
        print(
            f"| {name} | peak {'GPU memory' if RUN['accelerator'] == 'gpu' else 'RSS'}, every 1 | | "
            f"{memory['with'] / 2**20:.0f} MiB with, "
            f"{memory['without'] / 2**20:.0f} MiB without | | |"
        )
    print(
        "\nOne check against its lower bound: its loss evaluations, each at the measured cost of one forward on the"
        " probe batch, plus its backward (medians over the checks of the every-1 runs; vectorised passes evaluate"
        " several points per forward, so a check can beat this bound):\n"
    )
    print(
        "| model | probe samples, precision | loss evaluations | forward passes | backward | check time (median / mean)"
        " | lower bound | ratio | ratio by run |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in dict.fromkeys(name for name, _, _ in bounds):
        mine = [(report, bound) for n, report, bound in bounds if n == name]
        report = mine[-1][0]
        print(
            f"| {name} | {report.samples}, {report.precision} | "
            f"{statistics.median(r.n_forward for r, _ in mine):.0f} | "
            f"{statistics.median(r.n_passes for r, _ in mine):.0f} | {report.n_backward} | "
            f"{1e3 * statistics.median(r.duration_s for r, _ in mine):.1f} / "
            f"{1e3 * statistics.mean(r.duration_s for r, _ in mine):.1f} ms | "
            f"{1e3 * statistics.median(b for _, b in mine):.1f} ms | "
            f"{statistics.median(r.duration_s / b for r, b in mine):.2f}x | "
            f"{', '.join(f'{ratio:.2f}x' for ratio in per_run[name])} |"
        )


def defaults_table(models: dict[str, Any] | None = None) -> None:
    """GradWatch() at its defaults on each model of :data:`REALISTIC`: one run with and one without, long enough for
    the budget to matter; gradwatch's own share of the training time, the wall-time ratio, and what one check costs
    in training steps."""
    print(
        "| model | steps | checks (postponed) | applied checks | one check / one training step | "
        "one applied check / one training step | gradwatch's share (own time) | time with / without |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, (setup, steps) in (models or REALISTIC).items():
        build, loss, loader = setup(steps)
        without, _ = _fit(build, loss, loader, steps, None)
        watch = GradWatch()
        with_watch, _ = _fit(build, loss, loader, steps, watch)
        step_seconds = without / steps
        check = statistics.median(r.duration_s for r in watch.reports)
        applied = [r.duration_s for r in watch.applied_reports]
        applied_cost = f"{statistics.median(applied) / step_seconds:.1f}" if applied else "n/a"
        print(
            f"| {name} | {steps} | {len(watch.reports)} ({watch.counts['postponed']}) | {len(applied)} | "
            f"{check / step_seconds:.1f} | {applied_cost} | {100 * watch.overhead:.2f}% | {with_watch / without:.3f}x |"
        )


def long_table(rows: list[tuple[str, Any, int, int]], repeats: int) -> None:
    """``GradWatch()`` at its defaults in ``repeats`` runs per row, the first ones each after a run without a watch
    (A B A B ..., as many as the row says): the first checks' one-time cost in training steps, the share of the
    training time the checks take after them and in all (the watch's own clock: check time over the time between
    batches), and the wall-time ratio of each pair."""
    print(
        "| model | steps | checks made (recomputed, applied) | first checks, once (training steps) "
        "| share after them (own clock) | share in all (own clock) | time with / without (wall) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, setup, steps, pairs in rows:
        build, loss, loader = setup(steps)
        first, steady, share, ratios, made = [], [], [], [], []
        for run in range(repeats):
            without = _fit(build, loss, loader, steps, None)[0] if run < pairs else math.nan
            watch = GradWatch()
            with_watch, _ = _fit(build, loss, loader, steps, watch)
            clock = watch.watch._clock
            step_seconds = clock.train_seconds / steps
            first.append(clock.first_seconds / step_seconds)
            steady.append(100 * clock.steady_fraction)
            share.append(100 * clock.fraction)
            ratios += [with_watch / without] if run < pairs else []
            made.append(f"{len(watch.recomputed_reports)}, {len(watch.applied_reports)}")

        def cell(values: list[float], form: str) -> str:
            return f"{statistics.median(values):{form}} ({', '.join(f'{v:{form}}' for v in values)})"

        print(
            f"| {name} | {steps:,} | {'; '.join(made)} | {cell(first, '.1f')} | **{cell(steady, '.2f')}%** "
            f"| {cell(share, '.2f')}% | {cell(ratios, '.3f')}x |",
            flush=True,
        )


def first_checks_table(cases: list[tuple[str, nn.Module, Any, Callable[[nn.Module, Any], Tensor]]]) -> None:
    """The two checks ``GradientWatch()`` makes at step 1 of a plain loop, in training steps of the same process
    (CPU time of this thread; the applied one with the update check it leads to, timed as step 1's ``optimizer.step``
    beyond a later one's), next to the applied check's lower bound (one backward and four float64 forwards of the
    window, ``applied_lower_bound.py``)."""
    print(
        "| model | training step | applied check at step 1, with its update check (evaluations) "
        "| recomputed check at step 1 "
        "| both, in training steps | applied check's bound | both / bound |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, model, batch, loss in cases:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        watch = GradientWatch(verbose=False)
        steps, stepping, applied, recomputed, report = [], [], 0.0, 0.0, None
        for step in range(1, 13):
            started = time.thread_time()
            watch.record(batch)
            loss(model, batch).backward()
            before = time.thread_time()
            watch.before_optimizer_step(model, loss, step=step)
            after = time.thread_time()
            optimizer.step()  # the update check of step 1 runs in its post hook
            optimizer.zero_grad()
            checking = time.thread_time()
            stepping.append(checking - after)
            watch.maybe_check(model, batch, loss, step=step)
            ended = time.thread_time()
            if step == 1:
                applied, recomputed = after - before, ended - checking
                report = watch.applied_reports[0]
            elif step > 2:
                steps.append(ended - started - (after - before) - (ended - checking))
        step_seconds = statistics.median(steps)
        applied += max(stepping[0] - statistics.median(stepping[2:]), 0.0)  # with the update check it led to
        bound = _applied_bound(model, batch, loss) / step_seconds
        both = (applied + recomputed) / step_seconds
        evaluations = report.n_forward if report is not None else 0
        print(
            f"| {name} | {1e3 * step_seconds:.1f} ms | {applied / step_seconds:.1f} ({evaluations}) "
            f"| {recomputed / step_seconds:.1f} | **{both:.1f}** | {bound:.1f} | {both / bound:.2f}x |"
        )


def _applied_bound(model: nn.Module, batch: Any, loss: Callable[[nn.Module, Any], Tensor]) -> float:
    """One float32 forward and backward and four float64 forwards of the window (CPU time of this thread, medians of
    5): the least a healthy applied check with float64 probes costs."""
    precise = copy.deepcopy(model).double()
    precise_batch = [t.double() if t.is_floating_point() else t for t in batch]

    def timed(function: Callable[[], object]) -> float:
        function()
        times = []
        for _ in range(5):
            started = time.thread_time()
            function()
            times.append(time.thread_time() - started)
        return statistics.median(times)

    def backward() -> None:
        torch.autograd.grad(loss(model, batch), [p for p in model.parameters() if p.requires_grad])

    with torch.no_grad():
        forward64 = timed(lambda: loss(precise, precise_batch))
    return timed(backward) + 4 * forward64


def _first_cases() -> list[tuple[str, nn.Module, Any, Callable[[nn.Module, Any], Tensor]]]:
    """The models of ``applied_lower_bound.py`` (``applied.py``'s cost table, batch 64; this script's CNN and GPT) and
    this script's MLP."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import applied_models
    from applied_models import batch_for, cross_entropy

    cases: list[tuple[str, nn.Module, Any, Callable[[nn.Module, Any], Tensor]]] = []
    small = {"MLP": "MLP", "CNN (BatchNorm, dropout)": "CNN", "transformer (dropout)": "Transformer"}
    for label, make in ((label, getattr(applied_models, name)) for label, name in small.items()):
        torch.manual_seed(0)
        model = make()
        cases.append((f"{label}, `applied.py`, batch 64", model, batch_for(model, size=64, seed=1), cross_entropy))
    for label, (setup, _) in SHORT.items():
        build, loss, loader = setup(1)
        torch.manual_seed(0)
        cases.append((f"{label}, `overhead.py`", build(), next(iter(loader)), loss))
    build, loss, loader = _mlp_setup(1)
    torch.manual_seed(0)
    cases.append(("MLP (32-256-256-10), batch 64, `overhead.py`", build(), next(iter(loader)), loss))
    return cases


def check_cost_table(checks: int) -> None:
    """One healthy check of each model of :data:`REALISTIC` at GradWatch's settings, for a probe batch of one sample
    and of the default (two): loss evaluations, forward passes and the median time, against one training step."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(GradWatch).parameters.items()
        if name in ("tensor_probes", "random_probes", "param_probes", "input_probes", "precision", "vectorize")
    }
    default_samples = inspect.signature(GradWatch).parameters["probe_batch_size"].default
    print("| model | probe samples | verdicts | loss evaluations | forward passes | check (median) | training step |")
    print("|---|---|---|---|---|---|---|")
    for name, (setup, _) in REALISTIC.items():
        build, loss, loader = setup(4)
        torch.manual_seed(0)
        net = build()
        batch = next(iter(loader))
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        steps = []
        for _ in range(6):
            started = time.perf_counter()
            optimizer.zero_grad()
            loss(net, batch).backward()
            optimizer.step()
            steps.append(time.perf_counter() - started)
        for samples in dict.fromkeys((1, default_samples)):
            reports = [
                check_gradients(net, batch, loss, step=step, probe_batch_size=samples, **defaults)
                for step in range(checks + 1)
            ][1:]  # the first pays for one-time set-up
            verdicts = ", ".join(f"{n} {v}" for v, n in sorted(collections.Counter(r.verdict for r in reports).items()))
            print(
                f"| {name} | {samples} | {verdicts} | {statistics.median(r.n_forward for r in reports):.0f} | "
                f"{statistics.median(r.n_passes for r in reports):.0f} | "
                f"{1e3 * statistics.median(r.duration_s for r in reports):.1f} ms | "
                f"{1e3 * statistics.median(steps[2:]):.1f} ms |"
            )


def scale(steps: int) -> None:
    defaults = {
        name: p.default
        for name, p in inspect.signature(GradWatch).parameters.items()
        if name in ("tensor_probes", "random_probes", "param_probes", "input_probes", "probe_batch_size", "precision")
    }
    torch.manual_seed(0)
    net = GPT(50304, 768, 12, 12, 128)
    params = sum(p.numel() for p in net.parameters())
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    tokens = torch.randint(0, 50304, (8, 129))
    print(f"GPT: {params / 1e6:.0f}M parameters, batch 8 x 128 tokens, AdamW, CPU\n")
    print("| step | train step | check | loss evaluations | check / step | verdict | peak RSS during check |")
    print("|---|---|---|---|---|---|---|")
    for step in range(1, steps + 1):
        started = time.perf_counter()
        optimizer.zero_grad()
        _lm_loss(net, (tokens,)).backward()
        optimizer.step()
        train = time.perf_counter() - started
        with PeakResident() as memory:
            report = check_gradients(net, (tokens,), _lm_loss, step=step, **defaults)
        print(
            f"| {step} | {train:.2f} s | {report.duration_s:.2f} s | {report.n_forward} | "
            f"{report.duration_s / train:.2f} | {report.verdict} | {memory.peak / 2**30:.1f} GiB |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", action="store_true", help="a ~120M-parameter GPT instead of the table")
    parser.add_argument(
        "--defaults", action="store_true", help="only GradWatch() at its defaults, on the realistic models as well"
    )
    parser.add_argument("--check-cost", action="store_true", help="only one healthy check's cost on each model")
    parser.add_argument("--short", action="store_true", help="only the defaults in 600-step runs")
    parser.add_argument(
        "--long", action="store_true", help="the defaults in 600-, 1,000- and 10,000-step runs, with and without"
    )
    parser.add_argument("--first", action="store_true", help="only the two checks at step 1 of a plain loop")
    parser.add_argument("--repeats", type=int, default=3, help="A/B pairs per setting")
    parser.add_argument("--steps", type=int, default=256, help="training steps per run")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu", help="where the table's runs train")
    parser.add_argument(
        "--precision", choices=("32-true", "16-mixed", "bf16-mixed"), default="32-true", help="the Trainer's precision"
    )
    args = parser.parse_args()
    RUN.update(accelerator=args.accelerator, precision=args.precision)
    if args.scale:
        scale(3)
    elif args.defaults:
        defaults_table()
    elif args.short:
        defaults_table(SHORT)
    elif args.long:
        long_table(LONG, args.repeats)
    elif args.first:
        torch.set_num_threads(1)
        first_checks_table(_first_cases())
    elif args.check_cost:
        check_cost_table(12)
    else:
        overhead_table(args.repeats, args.steps)
        print()
        defaults_table()


if __name__ == "__main__":
    main()
