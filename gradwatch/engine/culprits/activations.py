"""The activation probes of a culprit search (:mod:`.search`): is autograd's gradient right at one place of one
module? Each place is probed along autograd's gradient there and along a random direction, with the verdict discipline
of every probe; evidence too near the tolerance to steer the search is reported undecided, and the search's budget is
kept here.

Whose error a failing input-gradient probe is (:func:`own_share`): the module's own backward, or the gradient reaching
its output.

A probe of a module's input place displaces its input by ``h·u`` and compares autograd's input gradient ``a_in``
(the module's backward applied to the gradient ``a_out`` at its output) with the loss's finite difference. When it
fails, either the module's backward is wrong, or ``a_out`` is. A probe of the output tells them apart only when the
error's share of ``a_out`` shows along its directions: where the output feeds several modules (a norm feeding an
attention's query, key and value projections), a bug in one is a tiny share of ``a_out`` and the output probe passes,
while the norm's backward, which removes ``a_out``'s dominant component, lets it through to its input at full size
(judged by the two probes, a correct norm was named for a bug in a LoRA layer after it).

The test here needs no probe of the output: displacing the input by ``h·u`` moves the module's output by ``J·u`` (the
derivative of its forward), and its backward is right exactly when ``a_in·u = a_out·(J·u)``. ``J·u`` is a central
difference of the module's own outputs at two steps (which bound its truncation error). The input probe's discrepancy
``D = a_in·u − numeric`` splits into the module's own share ``C = a_in·u − a_out·(J·u)`` and the output gradient's.

A failing probe of the module's own parameters splits the same way, ``J`` then the derivative of its output with
respect to them: a norm's weight gradient, wrong only because the gradient reaching it is (an error diluted past its
block's output probes), proves no bug inside the block.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gradwatch.engine.culprits.sites import Displacements, Site, floating
from gradwatch.engine.measuring.directions import HookedDirection
from gradwatch.engine.numerics.assessment import Assessment
from gradwatch.engine.numerics.kinks import at_a_tie
from gradwatch.engine.numerics.steps import relative_step
from gradwatch.engine.probing.ladder import Ladder
from gradwatch.engine.probing.portfolio import Portfolio
from gradwatch.engine.probing.search_budget import SearchBudget
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.results.kinds import ProbeKind
from gradwatch.errors import ExhaustedError

MAX_PROBES = 64
"""The most activation probes one search makes (two per place probed); a search that needs more names the deepest
module it proved."""

MAX_EVALUATIONS = 240
"""The most loss evaluations one search spends (a full stencil is 4, a confirmed failure 8): about what the check's
own probes cost, so that a failing check costs at most about twice one without the search; a less specific culprit
(the deepest module proved) is preferred to a search of minutes."""

BORDERLINE = (0.25, 1.25)
"""A place whose probes agree within this fraction of the tolerance is right, one whose probe fails by more than this
multiple of it wrong; in between (a correct module's float32 rounding, a bug diluted on its way upstream) the search
stops at the deepest module proven rather than guess (an RMSNorm bug near the tolerance named a correct layer)."""


class ActivationProbes:
    """The activation probes of one search, measured on demand and once each."""

    def __init__(
        self,
        sites: dict[str, Site],
        ladder: Ladder,
        portfolio: Portfolio,
        compute: torch.dtype,
        failing_params: frozenset[str] = frozenset(),
        budget: SearchBudget | None = None,
    ) -> None:
        self.sites = sites
        self.budget = budget
        self.failing_params = failing_params
        self.ladder = ladder
        self.portfolio = portfolio
        self.relative_step = relative_step(compute, portfolio.native_dtype)
        self.tasks: list[ProbeTask] = []
        self._measured: dict[tuple[str, str], Assessment | None] = {}
        self._failing: dict[tuple[str, str], tuple[list[torch.Tensor], ProbeTask]] = {}  # the direction that failed
        self._splits: dict[tuple[str, str], str | None] = {}
        self._extra = 0  # evaluations spent outside probes (the splits of failing input probes)
        self.may_stop: Callable[[], bool] = lambda: True  # whether the cap may stop the search now (it narrowed)
        self.capped = False  # whether the budget's cap stopped the search (not its limits of probes and evaluations)

    @property
    def evaluations(self) -> int:
        """The loss evaluations the search spent so far."""
        return self._extra + sum(task.evaluations for task in self.tasks)

    def _spend(self) -> None:
        """Raise :class:`ExhaustedError` past the search's limit of evaluations, or past its budget's cap once the
        search narrowed the culprit since its start (:attr:`may_stop`)."""
        if self.evaluations >= MAX_EVALUATIONS:
            raise ExhaustedError
        if self.budget is not None and self.budget.exhausted() and self.may_stop():
            self.capped = True
            raise ExhaustedError

    def split(self, site: Site, place: str = "module_input") -> str | None:
        """Whether the failing probe of ``place`` of ``site`` fails because of its own backward (``"own"``) or of the
        gradient reaching its output (``"downstream"``); ``None`` when it did not fail or the split cannot tell
        (:func:`own_share`)."""
        wrapped = [site]
        while place in site.same_as_parent and site.parent is not None:
            site = self.sites[site.parent]  # a wrapper: its input probe is its parent's
            wrapped.append(site)
        if (site.name, place) in self._splits:
            return self._splits[(site.name, place)]
        found = self._failing.get((site.name, place))
        if found is None:
            return None
        self._spend()
        components, task = found
        assert task.result is not None
        evaluate = self.ladder.measurements.evaluator.loss
        analytic = task.direction.analytic  # type: ignore[union-attr]
        self._extra += 4
        share = own_share(site, components, analytic, task.result.numeric, task.step, evaluate, place=place)
        self._splits[(site.name, place)] = share
        if share == DOWNSTREAM:
            self._outputs_wrong(wrapped, task.result)
        return share

    def _outputs_wrong(self, sites: list[Site], evidence: Assessment) -> None:
        """Record the gradient at the output of each of ``sites`` (a module and the wrappers whose input probe is its)
        wrong, with the failing probe's evidence: its input or parameter probe failed and its own backward passed on
        what reached its output (:func:`own_share`), whatever its output probes said. A diluted error passes them and
        is magnified by the module's backward (its norms remove the gradient's dominant component): taken as right, the
        module was searched and one inside it named, upstream of the bug."""
        wrong = dataclasses.replace(evidence, verdict="fail", reason="discrepancy")
        for site in sites:
            known = self._measured.get((site.name, "activation"))
            if known is None or known.verdict != "fail":
                self._measured[(site.name, "activation")] = wrong

    def known(self, site: Site, place: str) -> Assessment | None:
        """The probe of ``place`` of ``site`` if it was measured already (``None`` otherwise): nothing is spent."""
        return self._measured.get((site.name, place))

    def verdict(self, site: Site, place: str) -> Assessment | None:
        """The probe of ``place`` of ``site`` (the parent's where these are its tensors); ``None`` with nothing to
        displace."""
        key = (site.name, place)
        if key in self._measured:
            return self._measured[key]
        if place in site.same_as_parent and site.parent is not None:
            result = self.verdict(self.sites[site.parent], place)
        elif not site.probeable(place):
            result = None
        else:
            result = self._measure(site, place)
        self._measured[key] = result
        return result

    def _measure(self, site: Site, place: str) -> Assessment | None:
        """Two probes of the place: along autograd's gradient (the best signal, blind to an error orthogonal to it,
        such as a dropped projection term) and along a random direction; wrong if either fails, right if both agree."""
        self._spend()
        if len(self.tasks) >= MAX_PROBES:
            raise ExhaustedError
        grads = site.gradients[place]
        # a module called several times (shared weights, a recurrent cell): the error flows backwards through its
        # calls, so only its last call's output gradient comes from downstream, and only its last call's input
        # gradient is the module's own doing; the earlier calls are not displaced
        first = site.last_call.get(place, 0) if site.calls > 1 and place != "module_params" else 0
        active = [i >= first for i in range(len(grads))]
        if place == "module_params":
            active = [on and focus for on, focus in zip(active, self._focus(site, len(grads)), strict=True)]
        grads = [g if on else torch.zeros_like(g) for g, on in zip(grads, active, strict=True)]
        size = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        generator = torch.Generator().manual_seed(random.Random(f"gradwatch:{site.name}:{place}").getrandbits(63))
        raw = [
            torch.randn(g.shape, generator=generator, dtype=torch.float64) * on
            for g, on in zip(grads, active, strict=True)
        ]
        norm = math.sqrt(sum(float(r.square().sum()) for r in raw)) or 1.0
        randomly = [(r / norm).to(device=g.device, dtype=g.dtype) for r, g in zip(raw, grads, strict=True)]
        directions = [randomly] if size == 0.0 else [[g / size for g in grads], randomly]
        elements = sum(g.numel() for g in grads) or 1
        scale = site.scales.get(place, 0.0) / math.sqrt(elements) or self.portfolio.param_scale or 1.0
        floor = max(self.portfolio.negligible * size, self.portfolio.loss_floor)
        results = []
        for components in directions:
            slope = sum(float((g.double() * c.double()).sum()) for g, c in zip(grads, components, strict=True))
            displacements = Displacements(site, place, components)
            direction = HookedDirection(slope, displacements.set_offset)
            step = self.relative_step * scale
            task = ProbeTask(ProbeKind(place), site.name, None, direction, step, scale_floor=floor)
            self.tasks.append(task)
            with displacements.installed():
                self.ladder.measure_fully([task])
            assert task.result is not None
            if task.result.verdict == "fail" and at_a_tie(task.stencil):
                # a tie at the place (a max-pool window of a ReLU's exact zeros, displaced directly): the module's
                # function has no derivative there, and autograd's choice of one side is no wrong backward
                task.result = dataclasses.replace(task.result, verdict="inconclusive", reason="tie")
            results.append(task.result)
            if task.result.verdict == "fail" and (site.name, place) not in self._failing:
                self._failing[(site.name, place)] = (components, task)
            if task.result.verdict == "fail" and task.result.rel_error >= BORDERLINE[1] * self.ladder.rtol:
                break  # wrong along autograd's gradient: the random direction has nothing to add
        failed = [r for r in results if r.verdict == "fail"]
        if failed:
            # along the gradient when that one fails: its relative error is the error's share
            return self._decisive(failed[0], max(r.rel_error for r in failed) >= BORDERLINE[1] * self.ladder.rtol)
        if all(r.verdict == "ok" for r in results):
            worst = max(results, key=lambda r: r.rel_error)
            return self._decisive(worst, worst.rel_error <= BORDERLINE[0] * self.ladder.rtol)
        return next(r for r in results if r.verdict != "ok")

    def _focus(self, site: Site, count: int) -> list[bool]:
        """Which of the site's recorded parameter tensors a ``module_params`` probe displaces: the failing ones, where
        there are any (else all). Displaced with the correct ones, a wrong one's error is diluted (a 1% error in an
        LSTM's ``weight_hh_l0`` was 0.05% of the gradient of its four parameters, under the float32 tolerance)."""
        names = [f"{site.name}.{n}" if site.name else n for n in site.parameters]
        if not names or count % len(names):
            return [True] * count
        failing = [name in self.failing_params for name in names]
        if not any(failing):
            return [True] * count
        return [failing[i % len(names)] for i in range(count)]

    @staticmethod
    def _decisive(result: Assessment, clear: bool) -> Assessment:
        """The result, or, where its error is too near the tolerance to steer the search, an inconclusive one."""
        if clear:
            return result
        return dataclasses.replace(result, verdict="inconclusive", reason="unresolved")


OWN, DOWNSTREAM = "own", "downstream"

SHARE = 0.25
"""How far from 1 (own) or 0 (downstream) the module's share ``C/D`` may be, its truncation error included, for the
split to decide."""


def _pushed_forward(
    site: Site, place: str, components: list[Tensor], step: float, evaluate: Callable[[], float]
) -> list[Tensor] | None:
    """The module's floating outputs (every call's, in order) at ``+step`` minus at ``−step`` along ``components`` of
    ``place``, over ``2·step``; ``None`` when they do not match the recorded ones."""
    captured: list[list[Tensor]] = []

    def capture(_module: Any, _args: Any, output: Any) -> None:
        captured[-1] += [t.detach() for t in floating(output)]

    displacements = Displacements(site, place, components)
    with displacements.installed():
        handle = site.module.register_forward_hook(capture)
        try:
            for offset in (step, -step):
                captured.append([])
                displacements.set_offset(offset)
                evaluate()
        finally:
            handle.remove()
    plus, minus = captured
    recorded = site.gradients.get("activation", [])
    if len(plus) != len(recorded) or any(p.shape != g.shape for p, g in zip(plus, recorded, strict=True)):
        return None
    return [(p.double() - m.double()) / (2 * step) for p, m in zip(plus, minus, strict=True)]


def own_share(
    site: Site,
    components: list[Tensor],
    analytic: float,
    numeric: float,
    step: float,
    evaluate: Callable[[], float],
    *,
    place: str = "module_input",
) -> str | None:
    """Whether a failing probe of ``place`` of ``site`` (along ``components``, autograd's derivative ``analytic``, the
    loss's ``numeric``, at ``step``) fails because of the module's own backward (:data:`OWN`) or of the gradient at
    its output (:data:`DOWNSTREAM`); ``None`` when it cannot tell. Costs four loss evaluations through ``evaluate``."""
    discrepancy = analytic - numeric
    if discrepancy == 0.0:
        return None
    along: list[float] = []
    for h in (step, step / 2):
        moved = _pushed_forward(site, place, components, h, evaluate)
        if moved is None:
            return None
        pairs = zip(site.gradients["activation"], moved, strict=True)
        along.append(sum(float((g.double() * j).sum()) for g, j in pairs))
    truncation = abs(along[0] - along[1])
    through_output = (4 * along[1] - along[0]) / 3  # Richardson: the h² term cancels
    share = (analytic - through_output) / discrepancy
    if truncation > SHARE * abs(discrepancy):
        return None
    if abs(share - 1.0) <= SHARE:
        return OWN
    if abs(share) <= SHARE:
        return DOWNSTREAM
    return None
