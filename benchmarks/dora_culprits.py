"""DoRA culprits: a 3% error inside a PEFT ``DoraLinearLayer``'s forward, which module does a failing check name?

A tiny Llama (``tests/hf_stack_models.py``) with DoRA on ``q_proj`` and ``v_proj``; the error is a custom Function in
the forward of layer 1's ``q_proj`` DoRA module (``plant_dora_bug``): on its input, on the output of its ``lora_B``
call, on its result, or on ``base_result`` (the base layer's output it rescales). Each placement is checked over
several seeds (model and batch), without activation checkpointing and under ``gradient_checkpointing_enable``
(non-reentrant and reentrant). A culprit is **right** (the DoRA module or one inside it), **ancestor** (a module
containing it: the ``q_proj`` layer, its attention, decoder layer or model) or **wrong** (any other module).

Run: ``python benchmarks/dora_culprits.py`` (about three minutes on 2 CPU cores; ``--seeds 2`` for a smoke run).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hf_stack_models import plant_dora_bug, tiny_llama, token_ids

from gradwatch import check_gradients

DORA = "base_model.model.model.layers.1.self_attn.q_proj.lora_magnitude_vector.default"
PLACES = ("output", "lora_output", "input", "base_result")
MODES = {"plain": None, "non-reentrant": False, "reentrant": True}


def check(place: str, mode: bool | None, seed: int) -> tuple[str, str, float]:
    """The verdict, the culprit's judgement and the check's CPU seconds."""
    import peft

    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, use_dora=True
    )
    model = peft.get_peft_model(tiny_llama(seed=seed), config).train()
    if mode is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode})
        model.enable_input_require_grads()
    plant_dora_bug(model.get_submodule(DORA), place)
    ids = torch.tensor(token_ids(4, 12, seed=seed + 3))
    start = time.process_time()
    report = check_gradients(model, ids, lambda m, batch: m(input_ids=batch, labels=batch).loss)
    spent = time.process_time() - start
    if report.verdict != "fail":
        return str(report.verdict), "-", spent
    culprit = report.culprits[0] if report.culprits else ""
    if culprit == DORA or culprit.startswith(f"{DORA}."):
        judged = "right"
    elif culprit and DORA.startswith(f"{culprit}."):
        judged = f"ancestor ({culprit.rsplit('.', 1)[-1]})"
    else:
        judged = f"wrong ({culprit or 'none'})"
    return "fail", judged, spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print("| where the error is | checkpointing | checks failed | culprits | CPU s per failing check (median) |")
    print("|---|---|---|---|---|")
    for place in PLACES:
        for name, mode in MODES.items():
            results = [check(place, mode, seed) for seed in range(args.seeds)]
            failed = [r for r in results if r[0] == "fail"]
            judged = Counter(r[1] for r in failed)
            times = sorted(r[2] for r in failed)
            median = f"{times[len(times) // 2]:.1f}" if times else "-"
            words = ", ".join(f"{n} {j}" for j, n in judged.most_common()) or "-"
            print(f"| {place} | {name} | {len(failed)} of {len(results)} | {words} | {median} |", flush=True)


if __name__ == "__main__":
    main()
