"""The activation probes of a culprit search (:mod:`.search`): is autograd's gradient right at one place of one
module? Each place is probed along autograd's gradient there and along a random direction, with the verdict discipline
of every probe; evidence too near the tolerance to steer the search is reported undecided, and the search's budget is
kept here.
"""

from __future__ import annotations

import math
import random

import torch

from gradwatch.engine.culprits.sites import Displacements, Site
from gradwatch.engine.measuring.directions import HookedDirection
from gradwatch.engine.numerics.assessment import Assessment
from gradwatch.engine.numerics.steps import relative_step
from gradwatch.engine.probing.ladder import Ladder
from gradwatch.engine.probing.portfolio import Portfolio
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.results.kinds import ProbeKind

MAX_PROBES = 64
"""The most activation probes one search makes (two per place probed); a search that needs more names the deepest
module it proved."""

MAX_EVALUATIONS = 240
"""The most loss evaluations one search spends (a full stencil is 4, a confirmed failure 8): about what the check's
own probes and confirmations cost, so that a failing check costs at most about twice a check without the search. On a
large model evaluated point by point a search could otherwise cost minutes; a less specific culprit (the deepest module
proved when the budget ran out) is preferred to a slow one."""

BORDERLINE = (0.25, 1.25)
"""A place whose probes agree to within this fraction of the tolerance is right, one whose probe fails by more than
this multiple of it is wrong; in between (a correct module's float32 rounding, a bug's effect diluted on its way
upstream) the evidence cannot steer the search, which stops at the deepest module proven rather than guess: a
historical RMSNorm bug near the float32 tolerance named a correct layer when probes at the boundary decided."""


CLEAN_OUTPUT = 1e-2
"""A wrong input gradient proves the bug inside a module (where the children's order cannot) only if its output's error
is below this fraction of it: a correct backward can magnify a small error from downstream (a UNet block's time
embedding, summed over every pixel, read 38× its output's relative error), a wrong one leaves the output exact."""


class ExhaustedError(Exception):
    """The search made :data:`MAX_PROBES` probes."""


class ActivationProbes:
    """The activation probes of one search, measured on demand and once each."""

    def __init__(self, sites: dict[str, Site], ladder: Ladder, portfolio: Portfolio, compute: torch.dtype) -> None:
        self.sites = sites
        self.ladder = ladder
        self.portfolio = portfolio
        self.relative_step = relative_step(compute, portfolio.native_dtype)
        self.tasks: list[ProbeTask] = []
        self._measured: dict[tuple[str, str], Assessment | None] = {}

    @property
    def evaluations(self) -> int:
        """The loss evaluations the search spent so far."""
        return sum(task.evaluations for task in self.tasks)

    def verdict(self, site: Site, place: str) -> Assessment | None:
        """The probe of ``place`` of ``site``: measured (or taken from the parent whose tensors these are); ``None``
        when there is nothing to displace."""
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

    def clean_failure(self, site: Site) -> bool:
        """Whether ``site``'s input gradient fails while its output's error is below :data:`CLEAN_OUTPUT` of it: only
        then does the input gradient prove the bug inside ``site``."""
        entering, leaving = self.verdict(site, "module_input"), self.verdict(site, "activation")
        if entering is None or leaving is None or entering.verdict != "fail":
            return False
        return leaving.rel_error <= CLEAN_OUTPUT * entering.rel_error

    def _measure(self, site: Site, place: str) -> Assessment | None:
        """Two probes of the place: along autograd's gradient there (the best signal, blind to an error orthogonal to
        it, such as a dropped projection term) and along a random direction (which sees that error); the place is
        wrong if either fails, right if both agree."""
        if len(self.tasks) >= MAX_PROBES or self.evaluations >= MAX_EVALUATIONS:
            raise ExhaustedError
        grads = site.gradients[place]
        # a module called several times (shared weights, a recurrent cell): the error flows backwards through its
        # calls, so only its last call's output gradient comes from downstream, and only its last call's input
        # gradient is the module's own doing; the earlier calls are not displaced
        first = site.last_call.get(place, 0) if site.calls > 1 and place != "module_params" else 0
        active = [i >= first for i in range(len(grads))]
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
            results.append(task.result)
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

    @staticmethod
    def _decisive(result: Assessment, clear: bool) -> Assessment:
        """The result, or, where its error is too near the tolerance to steer the search, an inconclusive one."""
        if clear:
            return result
        fields = (result.numeric, result.discrepancy, result.noise, result.scale)
        return Assessment(*fields, "inconclusive", "unresolved", result.loss_noise)
