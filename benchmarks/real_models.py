"""Probes that evaluate the user's function: Hugging Face models, a peft LoRA, generative models, stock and user
surrogates, each fitted by a real ``Trainer`` with a check at every step, and what the fidelity machinery costs.

The models are those of the test suite (``tests/real_models.py``: tiny configs, random init, synthetic data):

* **correct models**: a ``fail`` is a false alarm, an ``inconclusive`` check one that told nothing;
* **planted bugs**: a 2% error in a hand-written backward (a LoRA adapter's, a VAE decoder's), caught at which check;
* **the cost of the fidelity machinery** on a healthy check: the float64 evaluation that keeps casts and random draws
  the model's own (:class:`gradwatch.engine.function.fidelity.Float64Fidelity`) measured against the same check with
  it switched off (interleaved, median of repeats). Switched off, a model that needs it gets other verdicts (the point
  of it), so the per-evaluation cost is measured on a forward of its own as well.

Run: ``python benchmarks/real_models.py`` (about a minute on 2 CPU cores; ``--steps`` checks per model).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from real_models import BUGGY, CORRECT, CausalLM, RealModel, fit

from gradwatch import CheckReport, check_gradients
from gradwatch.engine.function import evaluation
from gradwatch.engine.function.fidelity import Float64Fidelity


def _quiet() -> None:
    """Lightning's and transformers' chatter off: the tables are the output."""
    import logging

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers", "gradwatch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")


def _why(reports: list[CheckReport]) -> str:
    reasons = collections.Counter(p.reason for r in reports if r.verdict != "ok" for p in r.probes if p.verdict != "ok")
    return ", ".join(f"{reason} ({count})" for reason, count in reasons.most_common()) or "-"


def correct_models(steps: int) -> None:
    print(f"## Correct models (a check at each of {steps} training steps, GradWatch defaults otherwise)\n")
    print("| model | checks | ok | inconclusive | fail | why not ok | precision | evaluations (mean) | ms per check |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in CORRECT:
        _, watches = fit(model, steps=steps, every_n_steps=1, max_overhead=None)
        reports = [r for w in watches for r in w.reports]
        precisions = "/".join(sorted({r.precision for r in reports}))
        counts = collections.Counter(r.verdict for r in reports)
        print(
            f"| {model.name} | {len(reports)} | {counts['ok']} | {counts['inconclusive']} | {counts['fail']} | "
            f"{_why(reports)} | {precisions} | {statistics.mean(r.n_forward for r in reports):.1f} | "
            f"{1e3 * statistics.median(r.duration_s for r in reports):.0f} |"
        )
        for finding in dict.fromkeys(f for r in reports for f in r.surrogates):
            print(f"|  ↳ *{finding}* | | | | | | | | |")
    print()


def planted_bugs(steps: int) -> None:
    print("## Planted bugs (a check at every step)\n")
    print("| model | caught at check | failing tensors |")
    print("|---|---|---|")
    for model in BUGGY:
        _, (watch,) = fit(model, steps=steps, every_n_steps=1, max_overhead=None)
        first = next((i for i, r in enumerate(watch.reports, 1) if r.verdict == "fail"), None)
        named = sorted({p.target for r in watch.reports for p in r.failures if p.kind in ("tensor", "param")})
        shown = ", ".join(f"`{n.removeprefix('model.base_model.model.model.')}`" for n in named[:4])
        more = f" and {len(named) - 4} more" if len(named) > 4 else ""
        print(f"| {model.name} | {first or 'missed'} of {len(watch.reports)} | {shown}{more} |")
    print()


@contextlib.contextmanager
def _fidelity(enabled: bool) -> Iterator[None]:
    """The evaluator with its fidelity mode as shipped, or without any."""
    original = evaluation.Float64Fidelity
    if not enabled:
        evaluation.Float64Fidelity = _Inert  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        evaluation.Float64Fidelity = original  # type: ignore[misc]


class _Inert(Float64Fidelity):
    """Never entered: the evaluator drops a mode that did not act after the first evaluation, so this one costs a
    single no-op dispatch at most."""

    def __enter__(self) -> _Inert:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _loss_of(model: RealModel) -> tuple[torch.nn.Module, Any, Callable[[Any, Any], torch.Tensor]]:
    torch.manual_seed(0)
    module = model.module()
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    batch = next(iter(model.loader()))
    if isinstance(module, CausalLM):
        return module, batch, lambda m, b: m.model(input_ids=b[0], labels=b[0]).loss
    return module, batch, lambda m, b: m.training_step(b, 0)


def fidelity_cost(repeats: int) -> None:
    print(f"## The cost of the fidelity machinery on a healthy check (median of {repeats}, interleaved)\n")
    print(
        "| model | the mode acts on | check with it (ms) | without (ms) | evaluations with / without | verdict with / "
        "without | one float64 forward with / without (ms) |"
    )
    print("|---|---|---|---|---|---|---|")
    chosen = {
        "Hugging Face Llama": "casts",
        "VAE (randn_like)": "random draws",
        "diffusion noising step": "random draws",
        "spectral_norm, weight_norm, padding_idx": "nothing (dropped after the first evaluation)",
    }
    for model in CORRECT:
        if model.name not in chosen:
            continue
        module, batch, loss_fn = _loss_of(model)
        times: dict[bool, list[float]] = {True: [], False: []}
        reports: dict[bool, CheckReport] = {}
        for _ in range(repeats):
            for enabled in (True, False):
                with _fidelity(enabled):
                    report = check_gradients(module, batch, loss_fn, probe_batch_size=2)
                times[enabled].append(report.duration_s)
                reports[enabled] = report
        forward = {enabled: _forward_ms(module, batch, loss_fn, enabled, repeats) for enabled in (True, False)}
        print(
            f"| {model.name} | {chosen[model.name]} | {1e3 * statistics.median(times[True]):.1f} | "
            f"{1e3 * statistics.median(times[False]):.1f} | {reports[True].n_forward} / {reports[False].n_forward} | "
            f"{reports[True].verdict} / {reports[False].verdict} | {forward[True]:.2f} / {forward[False]:.2f} |"
        )
    print()


def _forward_ms(module: torch.nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor], mode: bool, n: int) -> float:
    """One no-grad forward of the loss on float64 copies, inside a fidelity mode or not."""
    copy = _float64_copy(module)
    batch64 = [t.double() if t.is_floating_point() else t for t in batch]
    samples = []
    with torch.no_grad():
        for _ in range(3 + n):
            started = time.perf_counter()
            with Float64Fidelity(torch.float32) if mode else contextlib.nullcontext():
                loss_fn(copy, batch64)
            samples.append(time.perf_counter() - started)
    return 1e3 * statistics.median(samples[3:])


def _float64_copy(module: torch.nn.Module) -> torch.nn.Module:
    import copy

    duplicate = copy.deepcopy(module)
    duplicate.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    return duplicate.double()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps (one check each) per model")
    parser.add_argument("--repeats", type=int, default=15, help="repeats of the fidelity-cost measurements")
    args = parser.parse_args()
    _quiet()
    started = time.perf_counter()
    correct_models(args.steps)
    planted_bugs(args.steps)
    fidelity_cost(args.repeats)
    print(f"({time.perf_counter() - started:.0f} s; torch {torch.__version__})")


if __name__ == "__main__":
    main()
