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
* a peft LoRA adapter and a VAE decoder with a 2% error in a hand-written backward;
* a custom LoRA variant whose forward reads its adapter's weights (a ``LoraVariant``, or a fused kernel replacing the
  layer's forward) with a 3% error in its hand-written backward, the input or the adapter's weight gradient;
* 2% backward bugs in library modules: a tiny Llama's MLP down-projection (which once named the correct
  ``post_attention_layernorm`` upstream of it), an attention output projection, the token embedding, a norm; a residual
  branch, with and without activation checkpointing; the historical RMSNorm bug near the float32 tolerance in an MLP
  (which once named a correct ``fc2``); the attention projections of a small diffusion UNet (ours, and diffusers'
  ``UNet2DModel`` when diffusers is installed);
* the bugs at special points of ``tests/special_point_models.py`` (a custom Function in the model's own code or in
  the loss).

Each culprit is judged against the module at fault: **right** (that module, or one inside it; for a bug in the model's
own code, the model; in the loss, ``<loss>``), **ancestor** (a module containing it: less specific, still true) or
**wrong** (any other module: a false accusation). The search runs on failing checks only; the last tables show what a
failing check costs and that healthy checks cost the same evaluations with and without the search.

Run: ``python benchmarks/culprits.py`` (a few minutes on 2 CPU cores; ``--seeds 1`` for a smoke run).
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
import hf_stack_models as hf
import real_models as rm
import special_point_models as sp
import unet_models

from gradwatch import CheckReport, GradWatch, check_gradients
from gradwatch.cli import demo_models
from gradwatch.engine.recomputed import probes as engine_probes
from gradwatch.engine.results.kinds import kinds_where

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


LORA_LAYER = "base_model.model.model.layers.1.self_attn.q_proj"


def _lora_variant(where: str, fused: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import peft

        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        model = peft.get_peft_model(hf.tiny_llama(), config).train()
        hf.plant_lora_variant_bug(model, LORA_LAYER, where, fused)
        return model

    return build


def _variant_tokens() -> torch.Tensor:
    return torch.tensor(hf.token_ids(4, 12, seed=7))


def _variant_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


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
    *(
        Case(
            f"custom LoRA variant reading its adapter's weights ({kind}), 3% {where} gradient",
            _lora_variant(where, kind == "fused kernel"),
            _variant_tokens,
            _variant_loss,
            LORA_LAYER,
        )
        for kind in ("LoraVariant", "fused kernel")
        for where in ("input", "weight")
    ),
    Case(
        "VAE decoder, 2%",
        lambda: rm.VAE(decoder_bug=1.02),
        _first(lambda: rm._vector_loader(12)),
        _step,
        "decoder_out",
    ),
]


def judged(report: CheckReport, holder: str) -> str:
    """``"right"``, ``"ancestor"``, ``"wrong"`` or ``"none"`` (no culprit named) for the report's culprit."""
    if not report.culprits:
        return "none"
    first = report.culprits[0]
    if first == holder or (holder not in ("", "<loss>") and first.startswith(f"{holder}.")):
        return "right"
    if holder != "<loss>" and first != "<loss>" and (first == "" or holder.startswith(f"{first}.")):
        return "ancestor"
    return "wrong"


def _special(name: str) -> Callable[[], Any]:
    return lambda: sp.CASES[name][1](torch.Generator().manual_seed(100))


LIBRARY_CASES = [
    Case(
        "Llama MLP down-projection, 2%",
        lambda: cm.llama_with_bug("model.layers.0.mlp.down_proj"),
        cm.tokens,
        cm.causal_lm_loss,
        "model.layers.0.mlp.down_proj",
    ),
    Case(
        "Llama attention output projection, 2%",
        lambda: cm.llama_with_bug("model.layers.1.self_attn.o_proj"),
        cm.tokens,
        cm.causal_lm_loss,
        "model.layers.1.self_attn.o_proj",
    ),
    Case(
        "Llama token embedding, 2%",
        lambda: cm.llama_with_bug("model.embed_tokens"),
        cm.tokens,
        cm.causal_lm_loss,
        "model.embed_tokens",
    ),
    Case(
        "Llama post-attention norm",
        lambda: cm.llama_with_bug("model.layers.0.post_attention_layernorm"),
        cm.tokens,
        cm.causal_lm_loss,
        "model.layers.0.post_attention_layernorm",
    ),
    Case("residual branch, 2%", cm.Residual, cm.batch, cm.cross_entropy, "blocks.1.branch.1"),
    Case(
        "residual branch, activation checkpointing",
        lambda: cm.Residual(checkpointed=True),
        cm.batch,
        cm.cross_entropy,
        "blocks.1.branch.1",
    ),
    Case("RMSNorm near the float32 tolerance (MLP)", cm.NormMLP, cm.batch, cm.cross_entropy, "blocks.1.1"),
    *(
        Case(
            f"UNet attention `{bug}`, 2%",
            lambda bug=bug: cm.TinyUNet(bug),
            cm.noisy_images,
            cm.noise_prediction_loss,
            bug,
        )
        for bug in ("mid.attention.to_out", "mid.attention.to_v")
    ),
    Case("BCE at logit 0", sp.ZeroHead, _special("BCE with logits, wrong at logit 0"), sp.bce_loss, "<loss>"),
    Case(
        "segment product at a zero",
        sp.CountFeatures,
        _special("segment product, wrong at an exact zero"),
        sp.regression_loss,
        "",
    ),
    Case(
        "grid_sample on the border", sp.Warp, _special("grid_sample, wrong on the border"), sp.classification_loss, ""
    ),
]

DIFFUSERS_CASES = [
    Case(
        f"diffusers UNet2DModel `{bug}`, 2%",
        lambda bug=bug: unet_models.small_unet(bug),
        unet_models.small_unet_batch,
        unet_models.noise_prediction_loss,
        bug,
    )
    for bug in ("mid_block.attentions.0.to_out.0", "down_blocks.1.attentions.0.to_v")
]


def search_evaluations(report: CheckReport) -> int:
    spent = [p.evaluations for p in report.probes if p.kind in SEARCH_KINDS]
    return sum(spent) + (1 if spent else 0)


def culprit_table(cases: list[Case], seeds: int) -> None:
    print(f"## Planted bugs ({seeds} seeds of the probe sampling each)\n")
    print(
        "| bug | module at fault | failing checks | right | ancestor | wrong | none | culprit named (first) | "
        "search evaluations (mean) | check evaluations (mean) | s per failing check |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    tally: dict[str, int] = {"right": 0, "ancestor": 0, "wrong": 0, "none": 0}
    for case in cases:
        reports, seconds = [], []
        for seed in range(seeds):
            torch.manual_seed(0)
            model = case.build()
            started = time.perf_counter()
            reports.append(check_gradients(model, case.batch(), case.loss, seed=seed, **SETTINGS))  # type: ignore[arg-type]
            seconds.append(time.perf_counter() - started)
        failing = [(r, t) for r, t in zip(reports, seconds, strict=True) if r.verdict == "fail"]
        verdicts = [judged(r, case.holder) for r, _ in failing]
        for verdict in verdicts:
            tally[verdict] += 1
        first = f"`{failing[0][0].culprits[0]}`" if failing and failing[0][0].culprits else "-"
        search = statistics.mean(search_evaluations(r) for r, _ in failing) if failing else float("nan")
        evaluations = statistics.mean(r.n_forward for r, _ in failing) if failing else float("nan")
        spent = statistics.mean(t for _, t in failing) if failing else float("nan")
        holder = f"`{case.holder}`" if case.holder else 'the model (`""`)'
        counts = " | ".join(str(verdicts.count(v)) for v in ("right", "ancestor", "wrong", "none"))
        print(
            f"| {case.name} | {holder} | {len(failing)}/{len(reports)} | {counts} | {first} | {search:.0f} | "
            f"{evaluations:.0f} | {spent:.1f} |"
        )
    total = sum(tally.values())
    print(
        f"\nof {total} failing checks: culprit right {tally['right']}, an ancestor {tally['ancestor']}, "
        f"wrong {tally['wrong']}, none {tally['none']}\n"
    )


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
    cases = CASES + LIBRARY_CASES
    try:
        import diffusers  # noqa: F401

        cases += DIFFUSERS_CASES
    except ImportError:
        print("(diffusers is not installed: its UNet2DModel cases are left out)\n")
    culprit_table(cases, args.seeds)
    healthy_cost(args.seeds)
    print(f"({time.perf_counter() - started:.0f} s; torch {torch.__version__})")


if __name__ == "__main__":
    main()
