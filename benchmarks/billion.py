"""Checks at 0.5B and 1B parameters: Llama-shaped models under ``transformers.Trainer`` with bf16, checkpointing, LoRA.

Each model is built from a ``transformers.LlamaConfig`` (random init, ``torch.manual_seed(0)``) and trains on synthetic
token sequences made on the spot (``--seq`` tokens, one sequence per micro-batch) under ``transformers.Trainer`` with
``bf16=True`` (CPU autocast), ``gradient_checkpointing=True``, ``gradient_accumulation_steps=4``, the Trainer's
default AdamW and ``max_grad_norm``, and ``GradWatchCallback(trainer)`` at its defaults (both kinds of check at step 1,
then within the 1% budget). Models:

* ``0.5B-lora``: about 0.5B parameters (24 layers, width 1280, grouped-query attention), a PEFT LoRA adapter (rank 8)
  on every linear layer of the blocks;
* ``0.5B-full``: the same model, every parameter trained;
* ``1B-lora``: TinyLlama's shape (22 layers, width 2048, 1.1B parameters) with the same adapter.

Per model, two processes (so that each one's memory is its own):

* ``healthy``: ``--steps`` optimizer steps. The training step is the median of steps 2 on (CPU time of the training
  thread, ``time.thread_time``, with one torch thread), the checks are the watch's calls that made them (the applied
  check in the Trainer's clipping call, the recomputed one at the end of step 1), timed on the same clock in the same
  process. Resident memory (``/proc/self/statm``) is sampled every 10 ms by a thread: a check's peak is the highest
  sample while it runs, a training step's the highest while steps 2 on run. After training, in the same process, the
  applied check's lower bound as ``benchmarks/applied_lower_bound.py`` defines it, on this model: one forward and
  backward of the window (as the Trainer trains: bf16 autocast, checkpointing) and four forwards of the window in
  the precision the check probed in (float64: the model converted in place; native: float32, autocast off), medians
  of ``--repeats``.
* ``bug``: the same model with a 2% backward bug in one layer's MLP (a custom autograd Function in ``down_proj``'s
  forward scales the gradient flowing back through its input by 1.02, as a hand-written kernel's backward would),
  trained until the first failing check or ``--bug-steps`` steps: that check's step and its culprit.

Run: ``python benchmarks/billion.py [--models 0.5B-lora 0.5B-full 1B-lora] [--seq 64]`` (tens of minutes to hours on
one CPU core: a benchmark, not a test). Peak resident memory measured: 4 GB (0.5B LoRA), 6.3 GB (1B LoRA); 0.5B
full fine-tuning passed 15 GB in its first applied check (``docs/benchmarks.md``, "At a billion parameters").
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES: dict[str, dict[str, int]] = {
    "0.5B": {"hidden_size": 1280, "intermediate_size": 3456, "num_hidden_layers": 24, "num_attention_heads": 20,
             "num_key_value_heads": 4},
    "1B": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
           "num_key_value_heads": 4},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
             "num_key_value_heads": 2},
}  # fmt: skip
"""Llama shapes (vocabulary 32,000, untied embeddings): about 0.5B parameters, TinyLlama's 1.1B, and a tiny one
(4M parameters) that runs the script in a minute."""

MODELS: dict[str, tuple[str, bool]] = {
    "0.5B-lora": ("0.5B", True), "0.5B-full": ("0.5B", False), "1B-lora": ("1B", True),
    "tiny-lora": ("tiny", True), "tiny-full": ("tiny", False),
}  # fmt: skip
"""Each benchmark model: its shape and whether a LoRA adapter is trained (else every parameter)."""

VOCAB = 32000
ACCUMULATION = 4
BUG_SCALE = 1.02
"""The planted bug: the gradient back through one layer's ``down_proj`` input is 2% too large."""


# --- the models and the data ------------------------------------------------------------------------------------


def build_model(name: str) -> nn.Module:
    shape, lora = MODELS[name]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=2048, **SHAPES[shape])
    model: nn.Module = transformers.LlamaForCausalLM(config)
    if lora:
        import peft

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        adapter = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0)
        model = peft.get_peft_model(model, adapter)
    return model


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same for a given index: ``input_ids`` and ``labels`` (the Llama shifts them)."""

    def __init__(self, count: int, length: int) -> None:
        self.count, self.length = count, length

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, VOCAB, (self.length,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens, "labels": tokens.clone()}


class ScaledBackward(torch.autograd.Function):
    """The identity forward; a backward 2% too large (the planted bug)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * BUG_SCALE


def plant_bug(model: nn.Module, layer: int) -> str:
    """The bug in layer ``layer``'s ``mlp.down_proj``: its forward runs its input through :class:`ScaledBackward`.
    Returns the module's name."""
    name, module = next((n, m) for n, m in model.named_modules() if n.endswith(f"layers.{layer}.mlp.down_proj"))
    original = module.forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return original(ScaledBackward.apply(x), *args, **kwargs)

    module.forward = forward
    return name


def trainer_for(model: nn.Module, steps: int, seq: int, output: str) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=output, max_steps=steps, per_device_train_batch_size=1, gradient_accumulation_steps=ACCUMULATION,
        bf16=True, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        use_cpu=True, report_to="none", save_strategy="no", logging_steps=10**6, seed=0, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(ACCUMULATION * steps, seq))


# --- clocks and memory ------------------------------------------------------------------------------------------


class ResidentMemory:
    """The process's resident memory, sampled every 10 ms by a daemon thread; :meth:`peak` is the highest sample in
    a span of wall time."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._running = True
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        with open("/proc/self/statm") as statm:
            while self._running:
                statm.seek(0)
                self.samples.append((time.perf_counter(), int(statm.read().split()[1]) * self._page))
                time.sleep(0.01)

    def peak(self, spans: list[tuple[float, float]]) -> int:
        return max((rss for t, rss in self.samples if any(a <= t <= b for a, b in spans)), default=0)


class Span:
    """The spans (CPU time of the calling thread, wall times) of the calls of a wrapped function, by step."""

    def __init__(self) -> None:
        self.cpu: dict[int, float] = {}
        self.wall: dict[int, tuple[float, float]] = {}

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, step: int, **kwargs: Any) -> Any:
            started, wall = time.thread_time(), time.perf_counter()
            try:
                return function(*args, step=step, **kwargs)
            finally:
                self.cpu[step] = self.cpu.get(step, 0.0) + time.thread_time() - started
                self.wall[step] = (self.wall.get(step, (wall, 0.0))[0], time.perf_counter())

        return timed


class StepSpans(transformers.TrainerCallback):
    """Each optimizer step's span, from ``on_step_begin`` to ``on_step_end`` (added first: before the check)."""

    def __init__(self) -> None:
        self.spans = Span()
        self._started = (0.0, 0.0)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._started = (time.thread_time(), time.perf_counter())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.spans.cpu[state.global_step] = time.thread_time() - self._started[0]
        self.spans.wall[state.global_step] = (self._started[1], time.perf_counter())


def watched(trainer: transformers.Trainer) -> tuple[Any, StepSpans, dict[str, Span]]:
    """``GradWatchCallback(trainer)`` at its defaults, with its watch's calls timed."""
    from gradwatch.integrations.huggingface import GradWatchCallback

    steps = StepSpans()
    trainer.add_callback(steps)
    callback = GradWatchCallback(trainer)
    trainer.add_callback(callback)
    calls = {"applied": Span(), "clipping": Span(), "recomputed": Span()}
    watch = callback.watch
    watch.before_optimizer_step = calls["applied"].wrap(watch.before_optimizer_step)  # type: ignore[method-assign]
    watch.after_clipping = calls["clipping"].wrap(watch.after_clipping)  # type: ignore[method-assign]
    watch.maybe_check = calls["recomputed"].wrap(watch.maybe_check)  # type: ignore[method-assign]
    return callback, steps, calls


PHASES = {
    "gradwatch.engine.applied.check": ("measure_window", "compare_accumulation", "recomputed_search"),
    "gradwatch.engine.recomputed.probes": ("_probe_with_inputs_if_accepted", "_swept", "confirm_precision",
                                           "confirm_at_a_shifted_point", "confirm_formula", "localize"),
}  # fmt: skip
"""The functions a failing check's phases run in, by module: the applied check's window and its culprit search (a
recomputed check), the recomputed check's probes, its sweep of tensor probes after a failure, its confirmations and
its culprit search."""


class Phases:
    """Where a failing check's time goes: CPU time of the thread and the model's forward passes, by phase of the
    check (the functions of :data:`PHASES`, each timed exclusive of the phases it calls), summed over the run."""

    def __init__(self, model: nn.Module) -> None:
        self.cpu: dict[str, float] = {}
        self.forwards: dict[str, int] = {}
        self._stack: list[str] = ["outside"]
        self._since = time.thread_time()
        model.register_forward_pre_hook(self._forward)
        for module_name, functions in PHASES.items():
            module = importlib.import_module(module_name)
            for function in functions:
                setattr(module, function, self._wrap(function, getattr(module, function)))

    def _forward(self, module: nn.Module, args: Any) -> None:
        self.forwards[self._stack[-1]] = self.forwards.get(self._stack[-1], 0) + 1

    def _switch(self) -> None:
        now = time.thread_time()
        self.cpu[self._stack[-1]] = self.cpu.get(self._stack[-1], 0.0) + now - self._since
        self._since = now

    def _wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._switch()
            self._stack.append(name)
            try:
                return function(*args, **kwargs)
            finally:
                self._switch()
                self._stack.pop()

        return timed


def report_fields(report: Any) -> dict[str, Any]:
    return {
        "step": report.step, "scope": report.scope, "verdict": str(report.verdict), "precision": report.precision,
        "evaluations": report.n_forward, "backwards": report.n_backward, "duration_s": report.duration_s,
        "culprits": list(report.culprits), "culprit_message": report.culprit_message,
        "notes": [note.text if hasattr(note, "text") else str(note) for note in report.notes],
    }  # fmt: skip


# --- the applied check's lower bound ----------------------------------------------------------------------------


def window(seq: int) -> list[dict[str, torch.Tensor]]:
    data = Tokens(ACCUMULATION, seq)
    return [{key: value[None] for key, value in data[i].items()} for i in range(ACCUMULATION)]


def _median_cpu(function: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.thread_time()
        function()
        times.append(time.thread_time() - started)
    return statistics.median(times)


def lower_bound(model: nn.Module, seq: int, precision: str, repeats: int) -> dict[str, float]:
    """``applied_lower_bound.py``'s bound on this model: the window's forward and backward as the Trainer runs it
    (bf16 autocast, checkpointing), and four forwards of the window in the check's probe precision. Converts the model
    to float64 in place when that precision is float64 (the last use of the model)."""
    batches = window(seq)
    model.train()

    def backward() -> None:
        for batch in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**batch).loss / ACCUMULATION
            loss.backward()
        model.zero_grad(set_to_none=True)

    def forwards() -> None:
        with torch.no_grad():
            for batch in batches:
                model(**batch)

    figures = {"backward_s": _median_cpu(backward, repeats)}
    figures["float32_forward_s"] = _median_cpu(forwards, repeats)
    if precision == "float64":
        model.double()
        figures["float64_forward_s"] = _median_cpu(forwards, repeats)
    probed = "float64" if precision == "float64" else "float32"
    figures["bound_s"] = figures["backward_s"] + 4 * figures[f"{probed}_forward_s"]
    return figures


# --- one process: a healthy run, or a run with the bug ----------------------------------------------------------


def healthy(name: str, steps: int, seq: int, repeats: int) -> dict[str, Any]:
    memory = ResidentMemory()
    model = build_model(name)
    parameters = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with tempfile.TemporaryDirectory() as output:
        trainer = trainer_for(model, steps, seq, output)
        callback, step_spans, calls = watched(trainer)
        trainer.train()
    reports = [report_fields(r) for r in callback.reports]
    checks = {scope: next((r for r in reports if r["scope"] == scope and r["step"] == 1), None)
              for scope in ("applied", "recomputed")}  # fmt: skip
    step_cpu = statistics.median(step_spans.spans.cpu[s] for s in range(2, steps + 1))
    training_spans = [step_spans.spans.wall[s] for s in range(2, steps + 1)]
    result: dict[str, Any] = {
        "model": name, "parameters": parameters, "trainable": trainable, "seq": seq, "steps": steps,
        "step_s": step_cpu, "steps_cpu": step_spans.spans.cpu, "reports": reports,
        "step_peak": memory.peak(training_spans), "threads": torch.get_num_threads(),
    }  # fmt: skip
    for scope, span in (("applied", calls["applied"]), ("recomputed", calls["recomputed"])):
        if checks[scope] is not None and 1 in span.cpu:
            result[f"{scope}_s"] = span.cpu[1]
            result[f"{scope}_peak"] = memory.peak([span.wall[1]])
    print("partial " + json.dumps(result), file=sys.stderr, flush=True)  # what a run stopped in the bound keeps
    trainer.optimizer = None  # AdamW's state is freed before the bound's float64 copy
    del trainer
    applied = checks["applied"]
    result["bound"] = lower_bound(model, seq, applied["precision"] if applied else "float64", repeats)
    memory._running = False
    return result


def with_bug(name: str, steps: int, seq: int, layer: int) -> dict[str, Any]:
    model = build_model(name)
    culprit = plant_bug(model, layer)
    phases = Phases(model)
    with tempfile.TemporaryDirectory() as output:
        trainer = trainer_for(model, steps, seq, output)
        callback, step_spans, calls = watched(trainer)

        class StopAtFailure(transformers.TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if any(str(r.verdict) == "fail" for r in callback.reports):
                    control.should_training_stop = True

        trainer.add_callback(StopAtFailure())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    return {
        "model": name, "planted": culprit, "reports": [report_fields(r) for r in callback.reports],
        "steps_cpu": step_spans.spans.cpu, "applied_cpu": calls["applied"].cpu,
        "recomputed_cpu": calls["recomputed"].cpu, "phases_cpu": phases.cpu, "phases_forwards": phases.forwards,
    }  # fmt: skip


# --- the table ----------------------------------------------------------------------------------------------------


def _row(healthy_run: dict[str, Any], bug_run: dict[str, Any] | None) -> str:
    step = healthy_run["step_s"]
    reports: dict[str, dict[str, Any]] = {}
    for report in healthy_run["reports"]:  # the check of each kind at step 1 (not the clip coefficient's after it)
        if report["step"] == 1:
            reports.setdefault(report["scope"], report)
    cells = [
        healthy_run["model"], f"{healthy_run['parameters'] / 1e6:.0f}M", f"{healthy_run['trainable'] / 1e6:.1f}M",
        f"{step:.1f}",
    ]  # fmt: skip
    for scope in ("recomputed", "applied"):
        report = reports.get(scope)
        if report is None or f"{scope}_s" not in healthy_run:
            cells.append("no check")
            continue
        cost = healthy_run[f"{scope}_s"]
        memory = healthy_run[f"{scope}_peak"] / healthy_run["step_peak"]
        text = f"{report['verdict']}, {report['precision']}: {cost:.0f} s = {cost / step:.1f} steps"
        if scope == "applied":
            bound = healthy_run["bound"]["bound_s"]
            text += f", {cost / bound:.2f}x its bound ({bound / step:.1f} steps)"
        cells.append(f"{text}; {report['evaluations']} evaluations; memory {memory:.2f}x")
    cells.append(f"{healthy_run['step_peak'] / 2**30:.1f} GiB")
    if bug_run is None:
        cells.append("not run")
    else:
        failing = next((r for r in bug_run["reports"] if r["verdict"] == "fail"), None)
        if failing is None:
            checked = ", ".join(f"{r['scope']} {r['verdict']} at {r['step']}" for r in bug_run["reports"])
            cells.append(f"not caught ({checked or 'no check'})")
        else:
            culprit = ", ".join(failing["culprits"]) or "no culprit"
            cells.append(f"{failing['scope']} check at step {failing['step']}: {culprit}")
    return "| " + " | ".join(cells) + " |"


def _in_process(args: argparse.Namespace, model: str, part: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", part, "--models", model, "--seq", str(args.seq),
               "--steps", str(args.steps), "--bug-steps", str(args.bug_steps), "--repeats", str(args.repeats),
               "--layer", str(args.layer)]  # fmt: skip
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if args.save:
        Path(args.save, f"{model}-{part}.json").write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["0.5B-lora", "0.5B-full", "1B-lora"], choices=list(MODELS))
    parser.add_argument("--seq", type=int, default=64, help="tokens per micro-batch (one sequence)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps of the healthy run")
    parser.add_argument("--bug-steps", type=int, default=1, help="most optimizer steps of the run with the bug")
    parser.add_argument("--repeats", type=int, default=2, help="repeats of each part of the lower bound (median)")
    parser.add_argument("--layer", type=int, default=6, help="the layer whose MLP gets the bug")
    parser.add_argument("--parts", nargs="+", default=["healthy", "bug"], choices=["healthy", "bug"])
    parser.add_argument("--save", help="a folder for each process's results (JSON)")
    parser.add_argument("--one", choices=("healthy", "bug"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.one:
        for logger in ("transformers", "gradwatch", "accelerate", "peft"):
            logging.getLogger(logger).setLevel(logging.ERROR)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's log lines
            if args.one == "healthy":
                result = healthy(args.models[0], args.steps, args.seq, args.repeats)
            else:
                result = with_bug(args.models[0], args.bug_steps, args.seq, args.layer)
        print(json.dumps(result))
        return
    print(f"{args.seq} tokens per micro-batch, accumulation {ACCUMULATION}, bf16 autocast, activation checkpointing, "
          f"AdamW; one thread, CPU time of the training thread; bug: x{BUG_SCALE} in layer {args.layer}'s "
          "mlp.down_proj backward\n")  # fmt: skip
    print("| model | parameters | trainable | training step (s) | recomputed check at step 1 | applied check at step 1 "
          "| training step's peak RSS | 2% MLP backward bug: first failing check, culprit |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        healthy_run = _in_process(args, model, "healthy") if "healthy" in args.parts else None
        bug_run = _in_process(args, model, "bug") if "bug" in args.parts else None
        if healthy_run is not None:
            print(_row(healthy_run, bug_run), flush=True)
        elif bug_run is not None:
            print(json.dumps(bug_run["reports"]), flush=True)


if __name__ == "__main__":
    main()
