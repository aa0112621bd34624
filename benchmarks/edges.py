"""Verdicts at the edges: correct models whose checked point sits on ties, kinks, rounding and zero gradients, and
bugs that only exist for batches of more than one sample.

Correct cases (a fail is a false alarm; an inconclusive check is a check that said nothing):

* a LeNet on MNIST-like images (exactly constant background, raw and normalised): exact max-pool ties at the point;
* a spatial transformer initialised to the identity (``grid_sample`` with every sample point on the grid);
* ops with exact ties (``max``/``amax`` over duplicates, ReLU at exact zeros, ``topk`` with ties, ``clamp`` at its
  bounds), piecewise-constant losses (``round``, ``floor``, ``sign``) and losses whose gradient is exactly zero;
* ``nn.Embedding(sparse=True)``;
* ``logcumsumexp`` over a large loss: a correct formula whose float32 gradient rounds beyond the float32 tolerance;
* a 3-conv CNN checked on a whole batch of 128 (``check_gradients``' default): near-ties that float32 rounds the
  other way than float64.

Planted bugs that only show with more than one sample: a centring backward that subtracts the mean over the whole
batch instead of each sample's, and a sparsemax backward with ``.squeeze()`` instead of ``.squeeze(-1)``.

Planted bugs at special points of a smooth loss, where a shifted point no longer shows them
(``tests/special_point_models.py``): a BCE-with-logits backward wrong at logit 0 (a zero-initialised head), a
segment-product backward wrong at an exact zero factor (sparse counts), a ``grid_sample`` border gradient wrong exactly
on the border (an identity-initialised warp); their correct twins run with the correct models.

Each case is checked with the defaults of ``GradWatch()`` (or of ``check_gradients`` where it says so) at several
training steps; bugs are caught if a check fails within three.

Run: ``python benchmarks/edges.py`` (a few minutes on 2 CPU cores; ``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import special_point_models as special

from gradwatch import CheckReport, GradWatch, check_gradients

DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(GradWatch).parameters.items()
    if name
    in ("tensor_probes", "random_probes", "param_probes", "input_probes", "probe_batch_size", "precision", "vectorize")
}
"""The engine settings of ``GradWatch()``."""


# ---- data ---------------------------------------------------------------------------------------------------------


def mnist_like(samples: int, generator: torch.Generator, normalise: bool) -> tuple[Tensor, Tensor]:
    """28x28 images, exactly 0 outside a few random strokes of 1 (exactly constant after ``Normalize`` too)."""
    images = special.stroke_images(samples, generator)
    if normalise:
        images = (images - 0.1307) / 0.3081
    return images, torch.randint(0, 10, (samples,), generator=generator)


# ---- correct models ----------------------------------------------------------------------------------------------


class LeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 6, 5), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(16 * 4 * 4, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


class SpatialTransformer(nn.Module):
    """A localisation network whose affine output starts at the identity, then ``grid_sample`` and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.localisation = nn.Sequential(nn.Conv2d(1, 8, 7), nn.MaxPool2d(2), nn.ReLU(), nn.Flatten())
        self.theta = nn.Linear(8 * 11 * 11, 6)
        nn.init.zeros_(self.theta.weight)
        with torch.no_grad():
            self.theta.bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0]))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))

    def forward(self, x: Tensor) -> Tensor:
        theta = self.theta(self.localisation(x)).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(x.shape), align_corners=True)
        return self.classifier(F.grid_sample(x, grid, padding_mode="border", align_corners=True))


class ThreeConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 32, 3, padding=1)])
        self.last = nn.Conv2d(32, 32, 3, padding=1)
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: Tensor) -> Tensor:
        for conv in self.convs:
            x = F.max_pool2d(F.relu(conv(x)), 2)
        return self.head(F.adaptive_max_pool2d(F.relu(self.last(x)), 4).flatten(1))


class Ties(nn.Module):
    """Ops with exact ties at the point: ``max``/``amax`` over duplicated values, ReLU at exact zeros, ``topk`` with
    ties and ``clamp`` at its bounds (the weights are quantised so that values repeat)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randint(-2, 3, (8, 16)).float() / 2)
        self.bias = nn.Parameter(torch.zeros(16))

    def forward(self, x: Tensor) -> Tensor:
        h = x @ self.weight + self.bias  # integer-valued inputs and weights: many exact ties and exact zeros
        out = F.relu(h).sum(-1) + h.amax(-1) + h.max(-1).values
        return out + h.topk(3, dim=-1).values.sum(-1) + h.clamp(-1.0, 1.0).sum(-1)


class PiecewiseConstant(nn.Module):
    """A loss that is a staircase in the parameters: its gradient is exactly zero almost everywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((8,), 1.7))

    def forward(self, x: Tensor) -> Tensor:
        return (x * self.scale).round().sum(-1) + torch.sign(x * self.scale).sum(-1) + (x * self.scale).floor().sum(-1)


class DeadReLU(nn.Module):
    """Every pre-activation negative: the loss does not depend on the first layer at the point, gradient exactly 0."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        with torch.no_grad():
            self.first.bias.fill_(-100.0)
        self.second = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(F.relu(self.first(x)))


class SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(100, 16, sparse=True)
        self.head = nn.Linear(16, 4)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.embedding(tokens).mean(1))


class LogCumSumExp(nn.Module):
    """``logcumsumexp`` of values near 1e4: float32 rounds ``exp(x_i - y_j)`` so coarsely that the float32 gradient of
    this correct formula is ~1e-3 off the derivative, beyond the float32 tolerance (5e-4)."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(1e4 + torch.randn(512))
        self.scale = nn.Parameter(torch.ones(512))

    def forward(self, x: Tensor) -> Tensor:
        return torch.logcumsumexp(x * self.scale + self.offset, dim=-1)


class ZeroGradient(nn.Module):
    """A staircase loss: ``round`` of the outputs, so every gradient is exactly zero and the loss is flat around the
    point (a check confirms the zero gradient along random directions)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return (10 * self.linear(x)).round()


class DetachedLoss(nn.Module):
    """A bug: the whole loss is computed from a detached output plus a zero-weighted term, so autograd gives every
    parameter an exactly zero gradient while the loss depends on them."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        out = self.linear(x)
        return out.detach() + 0.0 * out


# ---- bugs that need more than one sample -------------------------------------------------------------------------


class CentreFunction(torch.autograd.Function):
    """``x - mean(x)`` over the last dimension; ``correct=False``: the backward subtracts the mean over the whole
    tensor, which is the same thing for one sample only."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, correct: bool) -> Tensor:  # type: ignore[override]
        return x - x.mean(-1, keepdim=True)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, bool], output: Tensor) -> None:  # type: ignore[override]
        ctx.correct = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad - (grad.mean(-1, keepdim=True) if ctx.correct else grad.mean()), None


class SparsemaxFunction(torch.autograd.Function):
    """Sparsemax over the last dimension; ``correct=False``: ``.squeeze()`` where ``keepdim`` was meant in the backward,
    exact for one sample, broadcast wrongly for a batch (it raises where the batch size is not the width)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(z: Tensor, correct: bool) -> Tensor:  # type: ignore[override]
        sorted_z, _ = z.sort(dim=-1, descending=True)
        k = torch.arange(1, z.shape[-1] + 1, dtype=z.dtype, device=z.device)
        cumulative = sorted_z.cumsum(-1)
        support = (1 + k * sorted_z > cumulative).to(z.dtype)
        size = support.sum(-1, keepdim=True)
        tau = ((sorted_z * support).sum(-1, keepdim=True) - 1) / size
        return (z - tau).clamp(min=0)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, bool], output: Tensor) -> None:  # type: ignore[override]
        ctx.save_for_backward(output)
        ctx.correct = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (output,) = ctx.saved_tensors
        support = (output > 0).to(grad.dtype)
        size = support.sum(-1, keepdim=True)
        if not ctx.correct:
            # the bug: (batch, 1) -> (batch,), which broadcasts against (batch, 1) into (batch, batch); for one
            # sample it is a scalar, and right
            size = size.squeeze()
        mean = (grad * support).sum(-1, keepdim=True) / size
        return support * (grad - mean), None


class Centred(nn.Module):
    def __init__(self, correct: bool) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 32), nn.Linear(32, 4)
        self.correct = correct

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(CentreFunction.apply(self.first(x), self.correct)))


class Sparsemax(nn.Module):
    def __init__(self, correct: bool) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.correct = correct

    def forward(self, x: Tensor) -> Tensor:
        return SparsemaxFunction.apply(self.first(x), self.correct)


# ---- the cases ---------------------------------------------------------------------------------------------------


def _classification(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _regression(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.mse_loss(model(batch[0]).reshape(batch[1].shape), batch[1])


def _summed(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return (model(batch[0]) * batch[1]).sum()


def _sparsemax_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return (model(batch[0]) * batch[1]).sum()


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[Tensor, Tensor]]
    loss: Callable[[nn.Module, tuple[Tensor, Tensor]], Tensor]
    settings: dict[str, Any] = field(default_factory=dict)
    """Overrides of the defaults (``probe_batch_size=None``: ``check_gradients``' whole-batch default)."""
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = lambda params: torch.optim.SGD(params, lr=1e-2)


def _integers(g: torch.Generator, shape: tuple[int, ...]) -> Tensor:
    return torch.randint(-2, 3, shape, generator=g).float()


CORRECT = [
    Case("LeNet, MNIST-like (raw)", LeNet, lambda g: mnist_like(32, g, normalise=False), _classification),
    Case("LeNet, MNIST-like (normalised)", LeNet, lambda g: mnist_like(32, g, normalise=True), _classification),
    Case("spatial transformer at identity", SpatialTransformer, lambda g: mnist_like(16, g, True), _classification),
    Case(
        "3-conv CNN, whole batch of 128",
        ThreeConv,
        lambda g: (torch.randn(128, 3, 32, 32, generator=g), torch.randint(0, 10, (128,), generator=g)),
        _classification,
        {"probe_batch_size": None},
    ),
    Case("ops with exact ties", Ties, lambda g: (_integers(g, (16, 8)), torch.randn(16, generator=g)), _regression),
    Case(
        "piecewise-constant loss",
        PiecewiseConstant,
        lambda g: (torch.randn(16, 8, generator=g), torch.randn(16, generator=g)),
        _regression,
    ),
    Case(
        "zero gradient (dead ReLU layer)",
        DeadReLU,
        lambda g: (torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)),
        _regression,
    ),
    Case(
        "sparse embedding",
        SparseEmbedding,
        lambda g: (torch.randint(0, 100, (16, 6), generator=g), torch.randint(0, 4, (16,), generator=g)),
        _classification,
        optimizer=lambda params: torch.optim.SparseAdam(params[:1], lr=1e-2),
    ),
    Case(
        "logcumsumexp of values near 1e4",
        LogCumSumExp,
        lambda g: (torch.randn(4, 512, generator=g), torch.randn(4, 512, generator=g)),
        _summed,
    ),
    Case(
        "zero gradient everywhere (round)",
        ZeroGradient,
        lambda g: (torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)),
        lambda model, batch: model(batch[0]).sum(),
    ),
]

BUGS = [
    Case(
        "loss from a detached output: every gradient zero",
        DetachedLoss,
        lambda g: (torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)),
        _summed,
    ),
    Case(
        "centring backward: mean over the batch",
        lambda: Centred(correct=False),
        lambda g: (torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)),
        _classification,
    ),
    Case(
        "sparsemax backward: .squeeze() for .squeeze(-1)",
        lambda: Sparsemax(correct=False),
        lambda g: (torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)),
        _sparsemax_loss,
    ),
]

SPECIAL_POINTS = [
    Case(name, lambda build=build: build(correct=False), batch, loss)
    for name, (build, batch, loss) in special.CASES.items()
]

CONTROLS = [
    Case("centring backward (correct)", lambda: Centred(correct=True), BUGS[1].batch, _classification),
    Case("sparsemax backward (correct)", lambda: Sparsemax(correct=True), BUGS[2].batch, _sparsemax_loss),
    *(
        Case(f"{name.split(',')[0]} (correct)", lambda build=build: build(correct=True), batch, loss)
        for name, (build, batch, loss) in special.CASES.items()
    ),
]


@dataclass
class Tally:
    verdicts: collections.Counter[str] = field(default_factory=collections.Counter)
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    evaluations: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    first_failure: CheckReport | None = None


def run(case: Case, seeds: int, steps: int) -> Tally:
    """Check at every training step, ``steps`` steps per seed, passing each report's undecided tensors on."""
    tally = Tally()
    for seed in range(seeds):
        torch.manual_seed(seed)
        model = case.build()
        generator = torch.Generator().manual_seed(100 + seed)
        optimizer = case.optimizer(list(model.parameters()))
        report = None
        for step in range(steps):
            batch = case.batch(generator)
            settings = {**DEFAULTS, **case.settings}
            focus = report.undecided if report is not None else ()
            started = time.perf_counter()
            report = check_gradients(model, batch, case.loss, step=step, focus=focus, **settings)
            tally.seconds.append(time.perf_counter() - started)
            tally.verdicts[report.verdict] += 1
            tally.evaluations.append(report.n_forward)
            if report.verdict != "ok":
                reasons = {p.reason for p in report.probes if p.verdict == report.verdict} or {"no probe"}
                tally.reasons.update(reasons)
            if report.verdict == "fail" and tally.first_failure is None:
                tally.first_failure = report
            optimizer.zero_grad()
            case.loss(model, batch).backward()
            optimizer.step()
    return tally


def caught(case: Case, seeds: int, train: bool = False) -> list[int | None]:
    """For each seed, the check (1-3) that first failed, or ``None``; with ``train``, a training step (on the buggy
    gradient) between checks."""
    found: list[int | None] = []
    for seed in range(seeds):
        torch.manual_seed(seed)
        model = case.build()
        generator = torch.Generator().manual_seed(100 + seed)
        optimizer = case.optimizer(list(model.parameters()))
        first = None
        for step in range(3):
            batch = case.batch(generator)
            report = check_gradients(model, batch, case.loss, step=step, **{**DEFAULTS, **case.settings})
            if report.verdict == "fail":
                first = step + 1
                break
            if train:
                optimizer.zero_grad()
                case.loss(model, batch).backward()
                optimizer.step()
        found.append(first)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: one seed, few steps")
    args = parser.parse_args()
    seeds, steps = (1, 5) if args.quick else (3, 30)
    print(f"GradWatch defaults: {DEFAULTS}\n")
    print("## Correct models and operators (a check at every training step)\n")
    print("| case | checks | ok | inconclusive | fail | why not ok | evaluations (mean / max) | ms per check |")
    print("|---|---|---|---|---|---|---|---|")
    totals: collections.Counter[str] = collections.Counter()
    for case in [*CORRECT, *CONTROLS]:
        tally = run(case, seeds, steps)
        totals.update(tally.verdicts)
        reasons = ", ".join(f"{reason} ({n})" for reason, n in tally.reasons.most_common()) or "-"
        verdicts = tally.verdicts
        print(
            f"| {case.name} | {sum(verdicts.values())} | {verdicts['ok']} | {verdicts['inconclusive']} "
            f"| {verdicts['fail']} | {reasons} | {statistics.mean(tally.evaluations):.1f} / "
            f"{max(tally.evaluations)} | {1e3 * statistics.median(tally.seconds):.0f} |"
        )
        if tally.first_failure is not None:
            print(f"\nFALSE ALARM ({case.name}):\n{tally.first_failure}\n")
    checks = sum(totals.values())
    share = 100 * totals["inconclusive"] / checks
    print(f"| **all** | {checks} | {totals['ok']} | {totals['inconclusive']} ({share:.1f}%) | {totals['fail']} | | | |")
    print("\n## Bugs that need more than one sample (3 checks per seed)\n")
    print("| bug | caught (seeds) | at check |")
    print("|---|---|---|")
    for case in BUGS:
        found = caught(case, seeds)
        hits = [f for f in found if f is not None]
        print(f"| {case.name} | {len(hits)}/{seeds} | {', '.join(str(f) for f in hits) or '-'} |")
    print("\n## Bugs at special points of a smooth loss (3 checks per seed, training between them)\n")
    print("| bug | caught (seeds) | at check |")
    print("|---|---|---|")
    for case in SPECIAL_POINTS:
        found = caught(case, seeds, train=True)
        hits = [f for f in found if f is not None]
        print(f"| {case.name} | {len(hits)}/{seeds} | {', '.join(str(f) for f in hits) or '-'} |")


if __name__ == "__main__":
    main()
