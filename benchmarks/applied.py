"""The applied-gradient check (issue 23): planted path faults, the noise floor per precision, and the cost.

Usage: ``python benchmarks/applied.py [--seeds N] [--steps N]`` (CPU, a few minutes); ``--cost-only`` prints the cost
table alone, ``--device cuda`` measures it on a GPU (bf16 autocast on CUDA). Prints four markdown tables:

1. **planted faults**: each fault on the training's path only, the first applied check that caught it, the fault it
   named, the loss evaluations and backward passes the check took (attribution included);
2. **noise floor** per model and precision: the measured floor along the applied gradient relative to ``‖g‖`` (median
   and largest over seeds), the storage rounding of the precision for comparison, and the largest discrepancy of a
   healthy check in units of its tolerance (a failure needs more than 1);
3. the same floor on tiny **Hugging Face** Llama and GPT-2, with the check's time against the window's training;
4. **cost** per model and precision: one applied check in training steps (an optimizer step of the same model, batch
   and precision, timed the same way), its loss evaluations, and what the default cadence
   (``applied_every_n_steps``) costs before the budget.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from applied_models import (
    CNN,
    MLP,
    ChannelsLastPool,
    Transformer,
    batch_for,
    bf16,
    cross_entropy,
    scaled_once,
    train_window,
)

from gradwatch.engine.applied import AppliedWindow, check_applied_gradient
from gradwatch.engine.applied.verdict import storage_rounding
from gradwatch.watch.defaults import DEFAULT_APPLIED_EVERY_N_STEPS

MODELS = {"MLP": MLP, "CNN (BatchNorm, dropout)": CNN, "transformer (dropout)": Transformer}
PATHS: dict[str, Any] = {"32-true": None, "bf16-mixed": bf16}


def _precision(model: torch.nn.Module) -> Any:
    window = train_window(model, [batch_for(model, seed=1), batch_for(model, seed=2)], bf16)
    return window.check(cross_entropy, path=bf16)


def _accumulation(model: torch.nn.Module) -> Any:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_window(model, [batch_for(model, seed=1)])
    optimizer.step()
    return train_window(model, [batch_for(model, seed=2)], zero=False).check(cross_entropy)


def _mis_summed(model: torch.nn.Module) -> Any:
    window = AppliedWindow(model)
    model.zero_grad()
    for seed in (1, 2, 3):
        batch = batch_for(model, seed=seed)
        window.record(batch)
        cross_entropy(model, batch).backward()
    return window.check(cross_entropy, combine="mean")


def _transient(model: torch.nn.Module) -> Any:
    with scaled_once(model.fc1.weight, 3.0):  # type: ignore[arg-type]
        return train_window(model, [batch_for(model, seed=1), batch_for(model, seed=2)]).check(cross_entropy)


def _formula(model: torch.nn.Module) -> Any:
    handle = model.fc2.weight.register_hook(lambda grad: grad * 1.02)  # type: ignore[union-attr, operator]
    try:
        return train_window(model, [batch_for(model, seed=1)]).check(cross_entropy)
    finally:
        handle.remove()


def _compiled(model: torch.nn.Module) -> Any:
    compiled = torch.compile(model)
    batches = [batch_for(model, seed=1)]
    window = train_window(model, batches, forward=compiled)
    return check_applied_gradient(compiled, batches, cross_entropy, rng_states=window.rng_states)


FAULTS = [
    ("custom Function wrong only under bf16 autocast (x1.5)", "precision", lambda: MLP(autocast_fault=1.5), _precision),
    ("gradients not zeroed between windows", "accumulation", MLP, _accumulation),
    ("3 micro-batches summed, loss is their mean", "accumulation", MLP, _mis_summed),
    ("hook scales fc1.weight x3 once", "transient", MLP, _transient),
    ("hook scales fc2.weight x1.02 always", "formula", MLP, _formula),
    ("adaptive_max_pool3d channels-last, compiled (pytorch#197888)", "compiled", ChannelsLastPool, _compiled),
]


def planted() -> None:
    print("| planted fault (on the path only) | expected | caught at check | fault named | evaluations | backward |")
    print("|---|---|---|---|---|---|")
    for name, expected, make, run in FAULTS:
        torch.manual_seed(0)
        report = run(make())
        caught = "1st" if report.verdict == "fail" else "no"
        print(f"| {name} | {expected} | {caught} | {report.fault} | {report.n_forward} | {report.n_backward} |")
    print("\n(DDP communication hook scaling a bucket: `reduction`, tests/lightning/test_ddp_applied.py)\n")


def floors(seeds: int) -> None:
    print("| model | precision | floor / ‖g‖ median | floor / ‖g‖ max | storage rounding | worst healthy excess |")
    print("|---|---|---|---|---|---|")
    for name, make in MODELS.items():
        for precision, path in PATHS.items():
            values, excess = [], []
            for seed in range(seeds):
                torch.manual_seed(seed)
                model = make()
                window = train_window(model, [batch_for(model, seed=10 * seed + s) for s in (1, 2)], path)
                report = window.check(cross_entropy, path=path, culprit_search=False)
                assert report.verdict == "ok", str(report)
                values.append(report.noise_floor)
                excess.append(report.floor_excess)
            rounding = storage_rounding(torch.bfloat16 if path else torch.float32)
            print(
                f"| {name} | {precision} | {statistics.median(values):.2e} | {max(values):.2e} | {rounding:.2e} "
                f"| {max(excess):.2f} |"
            )
    print()


def _seconds(function: Any, repeats: int) -> float:
    function()  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - started) / repeats


def _cuda_bf16() -> Any:
    return torch.autocast("cuda", dtype=torch.bfloat16)


def _synchronized(function: Any, device: str) -> Any:
    def run() -> None:
        function()
        if device == "cuda":
            torch.cuda.synchronize()

    return run


def cost(steps: int, device: str = "cpu") -> None:
    print(f"({device}: {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'})\n")
    print("| model | precision | training step (ms) | applied check (ms) | in training steps | evaluations "
          f"| default cadence ({DEFAULT_APPLIED_EVERY_N_STEPS}) before the budget |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    paths = PATHS if device == "cpu" else {"32-true": None, "bf16-mixed": _cuda_bf16}
    for name, make in MODELS.items():
        for precision, path in paths.items():
            torch.manual_seed(0)
            model = make().to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            batch = tuple(t.to(device) for t in batch_for(model, size=64, seed=1))

            def step(
                model: torch.nn.Module = model, path: Any = path, batch: Any = batch, optimizer: Any = optimizer
            ) -> None:
                optimizer.zero_grad()
                with path() if path is not None else torch.autocast(device, enabled=False):
                    loss = cross_entropy(model, batch)
                loss.backward()
                optimizer.step()

            step_s = _seconds(_synchronized(step, device), steps)
            window = train_window(model, [batch], path)
            reports: list[Any] = []
            check = _synchronized(lambda w=window, p=path, r=reports: r.append(w.check(cross_entropy, path=p)), device)
            check_s = _seconds(check, 3)
            ratio = check_s / step_s
            print(
                f"| {name} | {precision} | {step_s * 1e3:.1f} | {check_s * 1e3:.0f} | {ratio:.1f} "
                f"| {reports[-1].n_forward} | {ratio / DEFAULT_APPLIED_EVERY_N_STEPS:.2%} |"
            )
    print()


def sensitivity(relative: float) -> None:
    """Each tensor of each model, in each precision, its gradient hooked ``×(1 + relative)`` (a formula fault seen by
    both kinds of check), one window of two micro-batches: is it caught at the first applied check?"""
    caught, total, missed = 0, 0, []
    for name, make in MODELS.items():
        for precision, path in PATHS.items():
            torch.manual_seed(0)
            model = make()
            for tensor, param in model.named_parameters():
                handle = param.register_hook(lambda grad: grad * (1 + relative))
                try:
                    window = train_window(model, [batch_for(model, seed=1), batch_for(model, seed=2)], path)
                    report = window.check(cross_entropy, path=path, culprit_search=False)
                finally:
                    handle.remove()
                total += 1
                caught += report.verdict == "fail"
                if report.verdict != "fail":
                    missed.append(f"{name} {precision} {tensor}")
    print(f"a {relative:.1%} fault in one tensor: caught at the first check in {caught} of {total}")
    print("missed: " + "; ".join(missed) + "\n")


def _language_model(family: str) -> torch.nn.Module:
    import transformers

    if family == "tiny Llama":
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config).train()
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(config).train()  # dropout 0.1


def _lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def language_models(seeds: int) -> None:
    """Tiny Hugging Face Llama and GPT-2 (dropout on), windows of two micro-batches of 4 x 16 tokens."""
    print("| model | precision | floor / ‖g‖ median | worst healthy excess | applied check / training step |")
    print("|---|---|---|---|---|")
    for family in ("tiny Llama", "tiny GPT-2"):
        for precision, path in PATHS.items():
            values, excess, ratios = [], [], []
            for seed in range(seeds):
                torch.manual_seed(seed)
                model = _language_model(family)
                generator = torch.Generator().manual_seed(seed)
                batches = [torch.randint(0, 64, (4, 16), generator=generator) for _ in range(2)]
                window = AppliedWindow(model)
                started = time.perf_counter()
                for ids in batches:
                    window.record(ids)
                    with path() if path is not None else torch.autocast("cpu", enabled=False):
                        loss = _lm_loss(model, ids)
                    (loss / 2).backward()
                step_s = time.perf_counter() - started
                report = window.check(_lm_loss, path=path, culprit_search=False)
                assert report.verdict == "ok", str(report)
                values.append(report.noise_floor)
                excess.append(report.floor_excess)
                ratios.append(report.duration_s / step_s)
            print(
                f"| {family} | {precision} | {statistics.median(values):.2e} | {max(excess):.2f} "
                f"| {statistics.median(ratios):.1f} |"
            )
    print()


def at_initialisation(seeds: int) -> None:
    """One applied check of the overhead benchmark's CIFAR CNN (batch 128, BatchNorm) at initialisation per seed, in a
    plain loop: its probes, their loss evaluations, and its CPU time over one forward and backward's."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import overhead

    def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    print("| seed | verdict | probes | evaluations | check / one forward and backward (CPU time) |")
    print("|---|---|---|---|---|")
    for seed in range(seeds):
        torch.manual_seed(seed)
        model = overhead.CNN()
        batch = (torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,)))
        started = time.process_time()
        window = AppliedWindow(model)
        window.record(batch)
        loss(model, batch).backward()
        step_s = time.process_time() - started
        started = time.process_time()
        report = window.check(loss)
        ratio = (time.process_time() - started) / step_s
        probes = ", ".join(f"{p.kind}" + (f" {p.target}" if p.target != "*" else "") for p in report.probes)
        evaluations = sum(p.evaluations or 0 for p in report.probes)
        print(f"| {seed} | {report.verdict} | {probes} | {evaluations} | {ratio:.1f} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cost-only", action="store_true", help="only the cost table")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the cost table runs")
    parser.add_argument("--sensitivity", type=float, help="only the one-tensor fault sweep at this relative size")
    parser.add_argument("--at-init", action="store_true", help="only the CIFAR CNN's first applied check, per seed")
    options = parser.parse_args()
    if options.device == "cpu":
        torch.set_num_threads(1)
    if options.sensitivity is not None:
        sensitivity(options.sensitivity)
        return
    if options.at_init:
        at_initialisation(options.seeds)
        return
    if options.cost_only:
        cost(options.steps, options.device)
        return
    planted()
    floors(options.seeds)
    language_models(options.seeds)
    cost(options.steps)


if __name__ == "__main__":
    main()
