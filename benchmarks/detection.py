"""How far gradwatch's verdicts can be trusted: false alarms on correct models, detection of planted bugs.

Five models (a ReLU MLP, a CNN with BatchNorm, max-pool and dropout, a transformer block on token embeddings with
dropout and LayerNorm, an LSTM, and the seed case: a sum-reduced MSE over 140x120), in float32 and float64, checked with
GradWatch's default settings (screen sizes, a probe batch of 1 sample, float64 probes) while they train on synthetic
data. As in the callback, each check re-probes the tensors the previous check of its series left undecided.

* False alarms: correct models train with Adam on a small fixed dataset (so late checks see the tiny gradients of a
  memorised dataset) and are checked at every step.
* Detection: each planted bug is checked at three consecutive training steps; a bug counts as detected if a check
  fails, and localized if the failing tensor, random, coordinate and input probes all name a tensor the bug touches.
* Sensitivity: one weight's gradient scaled by ``1 + r`` for decreasing ``r``; the smallest ``r`` detected within three
  checks for every seed.

Run: ``python benchmarks/detection.py`` (under a minute on 2 CPU cores; ``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import inspect
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradwatch import CheckReport, GradWatch, check_gradients
from gradwatch.engine.results.kinds import kinds_where

# ---- planted bugs that live in a model's own code -----------------------------------------------------------------


class CustomSiLU(torch.autograd.Function):
    """``x · σ(x)`` with a hand-written backward; ``correct=False`` drops the ``x · σ'(x)`` term.

    Written as torch.func wants a Function (``setup_context``, ``generate_vmap_rule``), so that gradwatch can evaluate
    the models' probe points in vectorised passes (``--no-vectorize`` measures the point-by-point path).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, correct: bool) -> Tensor:  # type: ignore[override]
        return x * torch.sigmoid(x)

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor, bool], output: Tensor) -> None:  # type: ignore[override]
        x, correct = inputs
        ctx.save_for_backward(x)
        ctx.correct = correct

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        local = s + x * s * (1 - s) if ctx.correct else s
        return grad * local, None


class InputGate(torch.autograd.Function):
    """The identity, whose backward scales the input gradient by ``factor`` (1 is correct)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor, float], output: Tensor) -> None:  # type: ignore[override]
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.factor, None


class Planted(nn.Module):
    """What every benchmark model shares: a custom-backward gate, a side branch that can be detached, an input gate."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.side = nn.Linear(width, width)
        self.silu_correct = True
        self.detach_side = False
        self.input_factor = 1.0

    def gate(self, x: Tensor) -> Tensor:
        return InputGate.apply(x, self.input_factor) if self.input_factor != 1.0 else x

    def mix(self, h: Tensor) -> Tensor:
        side = self.side(h)
        h = h + 0.5 * (side.detach() if self.detach_side else side)
        return CustomSiLU.apply(h, self.silu_correct)


class MLP(Planted):
    def __init__(self) -> None:
        super().__init__(64)
        self.fc1, self.fc2, self.head = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.fc1(self.gate(x)))
        h = self.mix(F.relu(self.fc2(h)))
        return self.head(h)


class CNN(Planted):
    def __init__(self) -> None:
        super().__init__(32)
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc, self.head = nn.Linear(16 * 4 * 4, 32), nn.Linear(32, 10)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x: Tensor) -> Tensor:
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(self.gate(x)))), 2)
        h = F.max_pool2d(F.relu(self.bn2(self.conv2(h))), 2)
        h = self.mix(self.fc(self.dropout(h.flatten(1))))
        return self.head(h)


class Transformer(Planted):
    def __init__(self) -> None:
        super().__init__(32)
        self.embedding = nn.Embedding(50, 32)
        self.position = nn.Parameter(0.02 * torch.randn(12, 32))
        self.block = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 50)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.block(self.embedding(tokens) + self.position)
        return self.head(self.mix(self.norm(h)))


class LSTM(Planted):
    def __init__(self) -> None:
        super().__init__(32)
        self.lstm = nn.LSTM(8, 32, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(self.gate(x))
        return self.head(self.mix(out[:, -1]))


class Seed(nn.Module):
    """The seed case: MSELoss(reduction="sum") over a 140x120 output, loss about 1e4."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 120)
        self.input_factor = 1.0

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(InputGate.apply(x, self.input_factor) if self.input_factor != 1.0 else x)


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[Tensor, Tensor]]
    loss: Callable[[nn.Module, tuple[Tensor, Tensor]], Tensor]
    weight: str
    """The tensor the scale, sign and slice bugs live in."""
    upstream: tuple[str, ...]
    """Tensors upstream of the custom SiLU (their gradients pass through it)."""


def _classification(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _language_model(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    logits = model(batch[0])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


def _seed_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.mse_loss(model(batch[0]), batch[1], reduction="sum")


CASES = [
    Case(
        "ReLU MLP",
        MLP,
        lambda g: (torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)),
        _classification,
        "fc2.weight",
        ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "side.weight", "side.bias"),
    ),
    Case(
        "CNN (BatchNorm, max-pool, dropout)",
        CNN,
        lambda g: (torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)),
        _classification,
        "conv2.weight",
        tuple(
            f"{layer}.{kind}" for layer in ("conv1", "bn1", "conv2", "bn2", "fc", "side") for kind in ("weight", "bias")
        ),
    ),
    Case(
        "Transformer block (embedding, dropout, LayerNorm)",
        Transformer,
        lambda g: (torch.randint(0, 50, (8, 12), generator=g), torch.randint(0, 50, (8, 12), generator=g)),
        _language_model,
        "block.linear1.weight",
        (
            "embedding.weight",
            "position",
            *(
                f"block.{n}"
                for n in (
                    "self_attn.in_proj_weight",
                    "self_attn.in_proj_bias",
                    "self_attn.out_proj.weight",
                    "self_attn.out_proj.bias",
                    "linear1.weight",
                    "linear1.bias",
                    "linear2.weight",
                    "linear2.bias",
                    "norm1.weight",
                    "norm1.bias",
                    "norm2.weight",
                    "norm2.bias",
                )
            ),
            "norm.weight",
            "norm.bias",
            "side.weight",
            "side.bias",
        ),
    ),
    Case(
        "LSTM",
        LSTM,
        lambda g: (torch.randn(16, 10, 8, generator=g), torch.randint(0, 4, (16,), generator=g)),
        _classification,
        "lstm.weight_hh_l0",
        ("lstm.weight_ih_l0", "lstm.weight_hh_l0", "lstm.bias_ih_l0", "lstm.bias_hh_l0", "side.weight", "side.bias"),
    ),
    Case(
        "Seed case (sum MSE, 140x120)",
        Seed,
        lambda g: (torch.randn(140, 64, generator=g), 10 * torch.randn(140, 120, generator=g)),
        _seed_loss,
        "fc.weight",
        (),
    ),
]

INPUT = "input"
"""Stands for any input probe in a bug's set of touched tensors."""

DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(GradWatch).parameters.items()
    if name
    in ("tensor_probes", "random_probes", "param_probes", "input_probes", "probe_batch_size", "precision", "vectorize")
}
"""The engine settings of ``GradWatch()``: the benchmark measures what users get by default."""


# ---- bugs -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bug:
    name: str
    plant: Callable[[nn.Module, Case], set[str]]
    """Plants the bug in the model; returns the tensors it touches (``INPUT`` for the input gradient)."""
    applies: Callable[[Case], bool] = lambda case: True
    holder: Callable[[Case], str] = lambda case: ""
    """The module holding the bug: the owner of the weight whose gradient a hook changes, or the model itself (``""``)
    for a bug in its own ``forward`` (the custom SiLU, the detached side branch and the input gate live there)."""


def _owner(case: Case) -> str:
    return case.weight.rsplit(".", 1)[0]


def culprit_named(report: CheckReport, holder: str) -> bool:
    """Whether the report's first culprit is the module holding the bug or a module inside it (for a bug in the model's
    own code, the model itself: every module is inside it, so nothing else counts)."""
    if not report.culprits:
        return False
    named = report.culprits[0]
    return named == holder or (holder != "" and named.startswith(f"{holder}."))


SEARCH_KINDS = kinds_where(culprit_search=True)

CULPRITS = [0, 0]
"""Culprits named, and bugs detected, over the bug table."""


def search_evaluations(report: CheckReport) -> int:
    """Loss evaluations the culprit search spent: its probes', and its recording pass when it made probes."""
    spent = [p.evaluations for p in report.probes if p.kind in SEARCH_KINDS]
    return sum(spent) + (1 if spent else 0)


def _hook(model: nn.Module, name: str, fn: Callable[[Tensor], Tensor]) -> None:
    dict(model.named_parameters())[name].register_hook(fn)


def _scaled(factor: float) -> Callable[[nn.Module, Case], set[str]]:
    def plant(model: nn.Module, case: Case) -> set[str]:
        _hook(model, case.weight, lambda g: g * factor)
        return {case.weight}

    return plant


def _slice(model: nn.Module, case: Case) -> set[str]:
    def hook(g: Tensor) -> Tensor:
        g = g.clone()
        rows = max(1, g.shape[0] // 10)
        g[:rows] *= 1.1
        return g

    _hook(model, case.weight, hook)
    return {case.weight}


def _missing_term(model: nn.Module, case: Case) -> set[str]:
    model.silu_correct = False  # type: ignore[assignment]
    return {*case.upstream, INPUT}


def _detached(model: nn.Module, case: Case) -> set[str]:
    model.detach_side = True  # type: ignore[assignment]
    return {*case.upstream, INPUT}


def _wrong_input(model: nn.Module, case: Case) -> set[str]:
    model.input_factor = 1.02  # type: ignore[assignment]
    return {INPUT}


BUGS = [
    Bug("weight grad x1.01", _scaled(1.01), holder=_owner),
    Bug("weight grad x1.10", _scaled(1.10), holder=_owner),
    Bug("sign flip", _scaled(-1.0), holder=_owner),
    Bug("missing backward term", _missing_term, lambda case: bool(case.upstream)),
    Bug("error in a slice (10% rows x1.1)", _slice, holder=_owner),
    Bug("detached branch", _detached, lambda case: bool(case.upstream)),
    Bug("wrong input grad (x1.02)", _wrong_input, lambda case: case.name != CASES[2].name),
]


# ---- running ----------------------------------------------------------------------------------------------------


def _build(case: Case, seed: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(seed)
    return case.build().to(dtype)


def _batches(case: Case, seed: int, dtype: torch.dtype, count: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(1000 + seed)
    batches = []
    for _ in range(count):
        x, y = case.batch(generator)
        batches.append((x.to(dtype) if x.is_floating_point() else x, y.to(dtype) if y.is_floating_point() else y))
    return batches


def _check(
    model: nn.Module,
    case: Case,
    batch: tuple[Tensor, Tensor],
    step: int,
    previous: CheckReport | None = None,
    **overrides: object,
) -> CheckReport:
    """One check as GradWatch runs it in a series: the tensors the previous check could not decide are probed again."""
    settings = {**DEFAULTS, **overrides}
    focus = previous.undecided if previous is not None else ()
    return check_gradients(model, batch, case.loss, step=step, rotation=step, focus=focus, **settings)  # type: ignore[arg-type]


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, case: Case, batch: tuple[Tensor, Tensor]) -> None:
    optimizer.zero_grad()
    case.loss(model, batch).backward()
    optimizer.step()


@dataclass
class Tally:
    checks: int = 0
    failed: int = 0
    inconclusive: int = 0
    evaluations: list[int] | None = None
    passes: list[int] | None = None
    vectorized: int = 0
    seconds: float = 0.0


def false_alarms(case: Case, dtype: torch.dtype, seeds: int, steps: int) -> Tally:
    """Train a correct model on a small fixed dataset, checking at every step."""
    tally = Tally(evaluations=[], passes=[])
    for seed in range(seeds):
        model = _build(case, seed, dtype)
        batches = _batches(case, seed, dtype, 4)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        report = None
        for step in range(steps):
            batch = batches[step % len(batches)]
            started = time.perf_counter()
            report = _check(model, case, batch, step, report)
            tally.seconds += time.perf_counter() - started
            tally.checks += 1
            tally.failed += report.verdict == "fail"
            tally.inconclusive += report.verdict == "inconclusive"
            assert tally.evaluations is not None
            assert tally.passes is not None
            tally.evaluations.append(report.n_forward)
            tally.passes.append(report.n_passes)
            tally.vectorized += report.vectorized is True
            if report.verdict == "fail":
                print(f"  FALSE ALARM {case.name} {dtype} seed {seed} step {step}:\n{report}")
            _train_step(model, optimizer, case, batch)
    return tally


@dataclass
class Detection:
    detected: int = 0
    localized: int = 0
    runs: int = 0
    checks_to_detect: list[int] | None = None
    evaluations: list[int] | None = None
    culprits: int = 0
    search: list[int] = field(default_factory=list)
    named: list[str] = field(default_factory=list)


def _localized(report: CheckReport, touched: set[str]) -> bool:
    named = [p for p in report.failures if p.kind in ("tensor", "random", "param", "input")]
    return bool(named) and all((INPUT if p.kind == "input" else p.target) in touched for p in named)


def detect(case: Case, bug: Bug, dtype: torch.dtype, seeds: int, checks: int = 3) -> Detection:
    result = Detection(checks_to_detect=[], evaluations=[])
    for seed in range(seeds):
        model = _build(case, seed, dtype)
        touched = bug.plant(model, case)
        batches = _batches(case, seed, dtype, checks)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        result.runs += 1
        report = None
        for step, batch in enumerate(batches):
            report = _check(model, case, batch, step, report)
            if report.verdict == "fail":
                result.detected += 1
                result.localized += _localized(report, touched)
                assert result.checks_to_detect is not None
                assert result.evaluations is not None
                result.checks_to_detect.append(step + 1)
                result.evaluations.append(report.n_forward)
                result.culprits += culprit_named(report, bug.holder(case))
                result.search.append(search_evaluations(report))
                result.named.append(report.culprits[0] if report.culprits else "-")
                if not _localized(report, touched):
                    print(f"  NOT LOCALIZED {case.name} {dtype} {bug.name} seed {seed}:\n{report}")
                break
            _train_step(model, optimizer, case, batch)
    return result


def smallest_detected(case: Case, dtype: torch.dtype, seeds: int, errors: list[float]) -> float:
    """The smallest relative error ``r`` (gradient scaled by ``1 + r``) detected within 3 checks for every seed."""
    smallest = math.nan
    for error in errors:
        bug = Bug(f"x(1+{error:g})", _scaled(1.0 + error))
        if detect(case, bug, dtype, seeds).detected < seeds:
            break
        smallest = error
    return smallest


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer seeds and steps")
    parser.add_argument("--part", choices=("all", "false-alarms", "bugs", "sensitivity"), default="all")
    parser.add_argument("--dtype", choices=("both", "float32", "float64"), default="both")
    parser.add_argument("--no-vectorize", action="store_true", help="evaluate every probe point on its own")
    args = parser.parse_args()
    if args.no_vectorize:
        DEFAULTS["vectorize"] = False
    seeds, steps, bug_seeds = (1, 20, 1) if args.quick else (2, 200, 3)
    dtypes = (torch.float32, torch.float64) if args.dtype == "both" else (getattr(torch, args.dtype),)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"GradWatch defaults: {DEFAULTS}\n")

    if args.part in ("all", "false-alarms"):
        _false_alarm_table(dtypes, seeds, steps)
    if args.part in ("all", "bugs"):
        _bug_table(dtypes, bug_seeds)
        print(f"\nculprit named for {CULPRITS[0]} of {CULPRITS[1]} detected bugs ({CULPRITS[0] / CULPRITS[1]:.0%})")
    if args.part in ("all", "sensitivity"):
        _sensitivity_table(dtypes, bug_seeds)


def _false_alarm_table(dtypes: tuple[torch.dtype, ...], seeds: int, steps: int) -> None:
    print("## False alarms on correct models (a check at every training step)\n")
    print(
        "| model | dtype | checks | failed checks | inconclusive checks | evaluations per check (mean/max) "
        "| forward passes per check (mean) | vectorised checks | ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    totals = {dtype: Tally() for dtype in dtypes}
    for case in CASES:
        for dtype in dtypes:
            t = false_alarms(case, dtype, seeds, steps)
            assert t.evaluations is not None
            assert t.passes is not None
            total = totals[dtype]
            total.checks += t.checks
            total.failed += t.failed
            total.inconclusive += t.inconclusive
            print(
                f"| {case.name} | {_dtype_name(dtype)} | {t.checks} | {t.failed} | {t.inconclusive} "
                f"({100 * t.inconclusive / t.checks:.1f}%) | {statistics.mean(t.evaluations):.1f} / "
                f"{max(t.evaluations)} | {statistics.mean(t.passes):.1f} | {t.vectorized} | "
                f"{1e3 * t.seconds / t.checks:.0f} |"
            )
    for dtype, total in totals.items():
        print(
            f"| **all** | {_dtype_name(dtype)} | {total.checks} | {total.failed} | {total.inconclusive} "
            f"({100 * total.inconclusive / total.checks:.1f}%) | | | | |"
        )


def _bug_table(dtypes: tuple[torch.dtype, ...], bug_seeds: int) -> None:
    print("\n## Planted bugs (3 checks at consecutive training steps per seed)\n")
    print(
        "| model | dtype | bug | detected | localized | checks until detection (mean / max) | loss evaluations | "
        "culprit named | culprit (first seed) | of which the culprit search |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in CASES:
        for dtype in dtypes:
            for bug in BUGS:
                if not bug.applies(case):
                    continue
                d = detect(case, bug, dtype, bug_seeds)
                assert d.checks_to_detect is not None
                assert d.evaluations is not None
                until = f"{statistics.mean(d.checks_to_detect):.1f} / {max(d.checks_to_detect)}" if d.detected else "-"
                evals = f"{statistics.mean(d.evaluations):.0f}" if d.detected else "-"
                holder = f"`{bug.holder(case)}`" if bug.holder(case) else 'the model (`""`)'
                first = f"`{d.named[0]}`" if d.named else "-"
                search = f"{statistics.mean(d.search):.0f}" if d.search else "-"
                print(
                    f"| {case.name} | {_dtype_name(dtype)} | {bug.name} | {d.detected}/{d.runs} | "
                    f"{d.localized}/{d.runs} | {until} | {evals} | {d.culprits}/{d.detected} ({holder}) | {first} | "
                    f"{search} |"
                )
                CULPRITS[0] += d.culprits
                CULPRITS[1] += d.detected


def _sensitivity_table(dtypes: tuple[torch.dtype, ...], bug_seeds: int) -> None:
    print("\n## Smallest relative error detected within 3 checks (every seed), one weight's gradient x (1 + r)\n")
    print(f"| model | {' | '.join(_dtype_name(d) for d in dtypes)} |")
    print(f"|---|{'---|' * len(dtypes)}")
    sweeps = {
        torch.float32: [1e-2, 3e-3, 1e-3, 5e-4, 3e-4, 1e-4],
        torch.float64: [1e-4, 1e-5, 3e-6, 1e-6, 3e-7, 1e-7],
    }
    for case in CASES:
        cells = [f"{smallest_detected(case, dtype, bug_seeds, sweeps[dtype]):g}" for dtype in dtypes]
        print(f"| {case.name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
