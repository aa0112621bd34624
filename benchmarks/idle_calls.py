"""What the watch's calls cost on a training step when no check is due, per adapter, in microseconds.

Every step of a watched run passes through the watch: a plain loop makes its calls (``record``,
``before_optimizer_step``, ``maybe_check``), Lightning's ``GradWatch`` and the Hugging Face ``GradWatchCallback`` run
their hooks. On a step where no check of any kind is due, those calls should cost next to nothing. This script trains a
small MLP for ``--steps`` steps at ``GradWatch()``'s defaults (both first checks at step 1, the next recomputed check
at step 500) and times the watch's calls and the adapters' hooks alone (the thread's CPU time, ``time.thread_time``,
one thread), on the steps after the first where no report came out; the training's own work inside a hook (the
Trainer's clipping, which the Hugging Face callback wraps) is measured apart and left out. The wrapper that times a
hook costs about half a microsecond per call; it is measured and subtracted.

With ``--count-calls`` it counts instead the function calls (Python functions and builtins, as ``cProfile`` counts
them) the same calls make per idle step: a figure no clock or load moves, where a loaded machine (a virtual machine's
stolen time) can inflate the microseconds several times over, clock reads included.

With ``--before PATH`` (a folder holding another version's ``gradwatch`` package, e.g. ``git archive <commit>
gradwatch | tar -x -C PATH``) it alternates, in this one process, runs of that version and of the one imported
otherwise, ``--rounds`` times each (gradwatch imported afresh for each run), and prints the median of each.

Run: ``OMP_NUM_THREADS=1 python benchmarks/idle_calls.py [--steps N] [--count-calls] [--before PATH --rounds R]``
(under a minute on one CPU core per round and version).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.fc2(torch.tanh(self.fc1(x)))
        if labels is None:
            return logits
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _batches(steps: int, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(size, 16, generator=generator), torch.randint(0, 4, (size,), generator=generator))
            for _ in range(steps)]  # fmt: skip


COUNT_CALLS = False
"""``--count-calls``: count the function calls of the wrapped calls instead of timing them."""


class _Calls:
    """A profile function counting the function calls it sees (while set with ``sys.setprofile``)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            self.count += 1


class _Clock:
    """The thread's CPU time spent in the calls it wraps, by step; what the wrapper itself costs is subtracted (or,
    with :data:`COUNT_CALLS`, the function calls they make)."""

    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}
        self.step = 0
        self.inner = 0.0  # the training's own work inside a wrapped call, left out
        self.overhead = 0.0 if COUNT_CALLS else _wrapper_cost()
        self.calls = _Calls()

    def timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        if COUNT_CALLS:
            return self._counted(call)

        @functools.wraps(call)
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            started, inner = time.thread_time(), self.inner
            try:
                return call(*args, **kwargs)
            finally:
                spent = time.thread_time() - started - (self.inner - inner) - self.overhead
                self.by_step[self.step] = self.by_step.get(self.step, 0.0) + spent

        return timed_call

    def _counted(self, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def counted_call(*args: Any, **kwargs: Any) -> Any:
            outer = sys.getprofile()  # a wrapped call inside another (clip_grad_norm_ in a hook) counts once
            before = self.calls.count
            sys.setprofile(self.calls)
            try:
                return call(*args, **kwargs)
            finally:
                sys.setprofile(outer)
                if outer is None:
                    # in millionths, so that idle_microseconds reads the count
                    self.by_step[self.step] = self.by_step.get(self.step, 0.0) + (self.calls.count - before) / 1e6

        return counted_call

    def training(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` as the training's own work: its time is not the watch's."""

        if COUNT_CALLS:

            @functools.wraps(call)
            def uncounted_call(*args: Any, **kwargs: Any) -> Any:
                outer = sys.getprofile()
                sys.setprofile(None)
                try:
                    return call(*args, **kwargs)
                finally:
                    sys.setprofile(outer)

            return uncounted_call

        @functools.wraps(call)
        def training_call(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                self.inner += time.thread_time() - started

        return training_call

    def idle_microseconds(self, busy: set[int]) -> tuple[float, int]:
        """The median over the idle steps (after the first, none in ``busy``) of the calls' time, and their count."""
        idle = [seconds for step, seconds in self.by_step.items() if step > 1 and step not in busy]
        return 1e6 * statistics.median(idle), len(idle)


def _wrapper_cost() -> float:
    """What one timed call of an empty function costs besides the function (two clock reads, the wrapper)."""

    def empty() -> None:
        return None

    costs = []
    for _ in range(5):
        started = time.thread_time()
        for _ in range(2000):
            t0 = time.thread_time()
            empty()
            time.thread_time() - t0
        costs.append((time.thread_time() - started) / 2000)
    return statistics.median(costs)


def _steps_with_reports(watch: Any) -> set[int]:
    return {report.step for report in watch.reports}


def plain_loop(steps: int) -> tuple[float, int]:
    """``record``, ``before_optimizer_step`` and ``maybe_check`` in a plain loop, as the README's loop makes them."""
    from gradwatch import GradientWatch

    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = GradientWatch(verbose=False)
    clock = _Clock()
    record, before, maybe_check = (clock.timed(call) for call in
                                   (watch.record, watch.before_optimizer_step, watch.maybe_check))  # fmt: skip
    watch.setup(model)
    watch.start(0)
    for step, batch in enumerate(_batches(steps), start=1):
        clock.step = step
        record(batch)
        optimizer.zero_grad()
        _loss(model, batch).backward()
        before(model, _loss, step=step)
        optimizer.step()
        maybe_check(model, batch, _loss, step=step)
    return clock.idle_microseconds(_steps_with_reports(watch))


def lightning(steps: int) -> tuple[float, int]:
    """Lightning's ``GradWatch``: its hooks that run at every step (``on_train_batch_start``,
    ``on_before_optimizer_step``, ``on_train_batch_end``)."""
    import lightning.pytorch as pl

    from gradwatch import GradWatch

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = MLP()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return _loss(self.net, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    callback = GradWatch(verbose=False)
    clock = _Clock()
    for hook in ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end"):
        setattr(callback, hook, clock.timed(getattr(callback, hook)))

    class Steps(pl.Callback):
        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            clock.step = trainer.global_step + 1

    trainer = pl.Trainer(
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Steps(), callback], accelerator="cpu",
    )  # fmt: skip
    trainer.fit(Module(), torch.utils.data.DataLoader(_batches(steps), batch_size=None))
    return clock.idle_microseconds(_steps_with_reports(callback.watch))


def hugging_face(steps: int) -> tuple[float, int]:
    """The Hugging Face ``GradWatchCallback``: its step hooks (``on_step_begin``, ``on_pre_optimizer_step``,
    ``on_step_end``) and its wrappers of the Trainer's ``compute_loss`` and ``clip_grad_norm_`` (the Trainer's own
    work inside those left out)."""
    from transformers import Trainer, TrainingArguments

    from gradwatch.integrations.huggingface import GradWatchCallback

    torch.manual_seed(0)
    data = [{"x": x, "labels": y} for batch in _batches(steps) for x, y in zip(*batch, strict=True)]
    with tempfile.TemporaryDirectory() as output:
        args = TrainingArguments(
            output_dir=output, max_steps=steps, per_device_train_batch_size=16, report_to=[], save_strategy="no",
            logging_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = Trainer(model=MLP(), args=args, train_dataset=data)
        callback = GradWatchCallback(trainer, verbose=False)
        clock = _Clock()
        for hook in ("on_step_begin", "on_pre_optimizer_step", "on_step_end", "on_train_begin"):
            setattr(callback, hook, clock.timed(getattr(callback, hook)))
        begin = callback.on_train_begin

        def on_train_begin(*args: Any, **kwargs: Any) -> Any:  # the wrappers the callback installs, timed too
            begin(*args, **kwargs)
            callback._compute_loss = clock.training(callback._compute_loss)
            callback._clip_grad_norm = clock.training(callback._clip_grad_norm)
            trainer.compute_loss = clock.timed(trainer.compute_loss)  # type: ignore[method-assign]
            trainer.accelerator.clip_grad_norm_ = clock.timed(trainer.accelerator.clip_grad_norm_)

        callback.on_train_begin = on_train_begin  # type: ignore[method-assign]

        class Steps:
            def __getattr__(self, name: str) -> Any:
                def event(args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                    if name == "on_step_begin":
                        clock.step = state.global_step + 1

                return event

        trainer.add_callback(Steps())
        trainer.pop_callback(callback)
        trainer.add_callback(callback)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    return clock.idle_microseconds(_steps_with_reports(callback.watch))


RUNS = (
    ("plain loop (`GradientWatch`)", "`record`, `before_optimizer_step`, `maybe_check`", plain_loop),
    ("Lightning `GradWatch`", "3 hooks", lightning),
    ("Hugging Face `GradWatchCallback`", "3 hooks, `compute_loss`, `clip_grad_norm_`", hugging_face),
)


def _import_from(path: str | None, added: list[str]) -> None:
    """gradwatch imported afresh at the next import: from ``path``, else from where it is found without it."""
    for name in [name for name in sys.modules if name == "gradwatch" or name.startswith("gradwatch.")]:
        del sys.modules[name]
    while added:
        sys.path.remove(added.pop())
    if path is not None:
        sys.path.insert(0, path)
        added.append(path)
    importlib.invalidate_caches()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--count-calls", action="store_true", help="count the function calls, not the time")
    parser.add_argument("--before", help="a folder holding another version's gradwatch, run in turn with this one")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each version, alternated (with --before)")
    options = parser.parse_args()
    global COUNT_CALLS
    COUNT_CALLS = options.count_calls
    torch.set_num_threads(1)
    versions = [("before", options.before), ("after", None)] if options.before else [("", None)]
    figure = "function calls per idle step (median)" if COUNT_CALLS else "µs per idle step (median, CPU time)"
    columns = " | ".join(f"{version}: {figure}" if version else figure for version, _ in versions)
    print(f"| adapter | calls per step | idle steps | {columns} |")
    print("|---|---|---|" + "---|" * len(versions))
    added: list[str] = []
    for name, calls, run in RUNS:
        figures: dict[str, list[float]] = {version: [] for version, _ in versions}
        for _ in range(options.rounds if options.before else 1):
            for version, path in versions:
                _import_from(path, added)
                value, idle = run(options.steps)
                figures[version].append(value)
        shown = " | ".join(f"{statistics.median(values):.{0 if COUNT_CALLS else 1}f}" for values in figures.values())
        print(f"| {name} | {calls} | {idle} | {shown} |", flush=True)


if __name__ == "__main__":
    main()
