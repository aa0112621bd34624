"""Culprits: does a failing check name the module whose backward is wrong, and what does the search cost?

Planted bugs at known modules (``tests/culprit_models.py``, the demo's models, ``tests/real_models.py``), each checked
with GradWatch's engine settings over several seeds of the probe sampling:

* a residual stack of 6 blocks with a wrong ``tanh`` backward in the first, a middle and the last block;
* a wrong backward in the loss itself, in functional code between two modules, in a module called twice, in a module
  returning a tuple with an integer tensor;
* a tiny Hugging Face Llama whose RMSNorm drops a term of its backward, in the first layer, a middle layer, the final
  norm;
* the demo's models: the RMSNorm bug, a gradient hook scaling one weight's gradient by 1.01, a penalty on detached
  weights;
* a peft LoRA adapter and a VAE decoder with a 2% error in a hand-written backward.

A culprit is named when ``report.culprits[0]`` is the module holding the bug or a module inside it (for a bug in the
model's own code, the model itself). The search runs on failing checks only; the last table shows healthy checks cost
the same evaluations with and without it.

Run: ``python benchmarks/culprits.py`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import culprit_models as cm
import real_models as rm

from gradwatch import CheckReport, GradWatch, check_gradients
from gradwatch.cli import demo_models
from gradwatch.engine import probes as engine_probes
from gradwatch.engine.kinds import kinds_where

SETTINGS = {
    name: parameter.default
    for name, parameter in inspect.signature(GradWatch).parameters.items()
    if name
    in ("tensor_probes", "random_probes", "param_probes", "input_probes", "probe_batch_size", "precision", "vectorize")
}
SEARCH_KINDS = kinds_where(culprit_search=True)


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    holder: str
    """The module holding the bug (``""``: the model's own code; ``"<loss>"``: the loss function's)."""


def _step(module: nn.Module, batch: Any) -> torch.Tensor:
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    return module.training_step(batch, 0)  # type: ignore[operator]


def _classification() -> Any:
    generator = torch.Generator().manual_seed(2)
    return torch.randn(16, 32, generator=generator), torch.randint(0, 4, (16,), generator=generator)


def _first(loader: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: next(iter(loader()))


def _lora() -> nn.Module:
    return rm.CausalLM("llama", lora=True, lora_bug=1.02)


def _lora_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    return module.model(input_ids=batch[0], labels=batch[0]).loss


CASES = [
    *(
        Case(
            f"residual stack, block {i} of 6", lambda i=i: cm.Stack(bug_at=i), cm.batch, cm.cross_entropy, f"blocks.{i}"
        )
        for i in (0, 3, 5)
    ),
    Case("wrong backward in the loss", cm.Stack, cm.batch, cm.loss_with_wrong_backward, "<loss>"),
    Case("functional code between modules", cm.Functional, cm.batch, cm.cross_entropy, ""),
    Case("module called twice", cm.Shared, cm.batch, cm.cross_entropy, "shared"),
    Case("module with tuple and integer outputs", cm.TupleModel, cm.batch, cm.cross_entropy, "pair"),
    *(
        Case(f"Llama RMSNorm `{norm}`", lambda n=norm: cm.llama_with_wrong_norm(n), cm.tokens, cm.causal_lm_loss, norm)
        for norm in ("model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm")
    ),
    Case(
        "demo: RMSNorm",
        lambda: demo_models.CustomNormClassifier(correct_backward=False),
        _classification,
        _step,
        "net.1",
    ),
    Case("demo: gradient hook x1.01", demo_models.ScaledGradClassifier, _classification, _step, "net.4"),
    Case("demo: penalty on detached weights", demo_models.DetachedPenaltyClassifier, _classification, _step, "<loss>"),
    Case("peft LoRA adapter, 2%", _lora, _first(rm._token_loader), _lora_loss, "model.base_model.model.model.layers"),
    Case(
        "VAE decoder, 2%",
        lambda: rm.VAE(decoder_bug=1.02),
        _first(lambda: rm._vector_loader(12)),
        _step,
        "decoder_out",
    ),
]


def named(report: CheckReport, holder: str) -> bool:
    if not report.culprits:
        return False
    first = report.culprits[0]
    return first == holder or (holder not in ("", "<loss>") and first.startswith(f"{holder}."))


def search_evaluations(report: CheckReport) -> int:
    spent = [p.evaluations for p in report.probes if p.kind in SEARCH_KINDS]
    return sum(spent) + (1 if spent else 0)


def culprit_table(seeds: int) -> None:
    print(f"## Planted bugs ({seeds} seeds of the probe sampling each)\n")
    print(
        "| bug | module holding it | named | culprit named (first seed) | search evaluations (mean) | "
        "check evaluations (mean) |"
    )
    print("|---|---|---|---|---|---|")
    total = found = 0
    for case in CASES:
        reports = []
        for seed in range(seeds):
            torch.manual_seed(0)
            model = case.build()
            reports.append(check_gradients(model, case.batch(), case.loss, seed=seed, **SETTINGS))  # type: ignore[arg-type]
        failing = [r for r in reports if r.verdict == "fail"]
        hits = sum(named(r, case.holder) for r in failing)
        total += len(reports)
        found += hits
        first = f"`{failing[0].culprits[0]}`" if failing and failing[0].culprits else "-"
        search = statistics.mean(search_evaluations(r) for r in failing) if failing else float("nan")
        evaluations = statistics.mean(r.n_forward for r in failing) if failing else float("nan")
        holder = f"`{case.holder}`" if case.holder else 'the model (`""`)'
        print(f"| {case.name} | {holder} | {hits}/{len(reports)} | {first} | {search:.0f} | {evaluations:.0f} |")
    print(f"\nculprit named in {found} of {total} failing checks ({found / total:.0%})\n")


def healthy_cost(seeds: int) -> None:
    print(f"## Healthy checks with and without the culprit search ({seeds} seeds each)\n")
    print("| model | evaluations with the search (mean) | without | culprits named |")
    print("|---|---|---|---|")
    healthy = [
        ("residual stack", cm.Stack, cm.batch, cm.cross_entropy),
        ("Llama", lambda: cm.llama_with_wrong_norm(None), cm.tokens, cm.causal_lm_loss),
        ("demo MLP", demo_models.HealthyClassifier, _classification, _step),
    ]
    original = engine_probes.localize
    for name, build, batch, loss in healthy:
        counts: dict[bool, list[int]] = {True: [], False: []}
        culprits = 0
        for search in (True, False):
            engine_probes.localize = original if search else (lambda *args, **kwargs: None)  # type: ignore[assignment]
            try:
                for seed in range(seeds):
                    torch.manual_seed(0)
                    report = check_gradients(build(), batch(), loss, seed=seed, **SETTINGS)  # type: ignore[arg-type]
                    counts[search].append(report.n_forward)
                    culprits += bool(report.culprits)
            finally:
                engine_probes.localize = original
        print(f"| {name} | {statistics.mean(counts[True]):.1f} | {statistics.mean(counts[False]):.1f} | {culprits} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    started = time.perf_counter()
    culprit_table(args.seeds)
    healthy_cost(args.seeds)
    print(f"({time.perf_counter() - started:.0f} s; torch {torch.__version__})")


if __name__ == "__main__":
    main()
