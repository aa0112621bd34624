"""The module at which autograd's gradient turns from healthy to faulty, read off the gradients at every module's
boundary (:func:`~.sites.trace_sites`) without a probe, for faults a single backward shows (a non-finite gradient, a
gradient that does not scale with its upstream gradient).

The error flows backwards: a module whose output gradient is healthy and whose input or parameter gradient is not
holds the fault; the innermost is named, then the ones containing it. Where no module's output gradient is healthy
while some gradient is faulty, the loss's own code is (:data:`~.words.LOSS`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gradwatch.engine.culprits.reads import within
from gradwatch.engine.culprits.sites import Site
from gradwatch.engine.culprits.words import LOSS
from gradwatch.engine.results.kinds import ProbeKind

INWARD = (ProbeKind.MODULE_INPUT, ProbeKind.MODULE_PARAMS)
"""The places whose gradient a module's own backward computes from the gradient at its outputs."""

PlaceTest = Callable[[Site, str], bool]
"""Whether the gradients at one place of a site are faulty."""


def turning_point(sites: Mapping[str, Site], faulty: PlaceTest) -> list[str]:
    """The innermost module whose output gradient is healthy and whose input or parameter gradient is ``faulty``, then
    the modules containing it that are alike, most specific first; ``[LOSS]`` where only outputs are; else ``[]``."""
    wrong_inside = [
        site
        for site in sites.values()
        if not faulty(site, ProbeKind.ACTIVATION) and any(faulty(site, place) for place in INWARD)
    ]
    if wrong_inside:
        innermost = [s for s in wrong_inside if not any(within(o.name, s.name) for o in wrong_inside if o is not s)]
        first = min(innermost, key=lambda s: s.order)
        outer = [s for s in wrong_inside if s is not first and within(first.name, s.name)]
        outer.sort(key=lambda s: -len(s.name))
        return [first.name, *(s.name for s in outer)]
    if any(faulty(site, place) for site in sites.values() for place in (ProbeKind.ACTIVATION, *INWARD)):
        return [LOSS]
    return []


def described(name: str, sites: Mapping[str, Site]) -> str:
    """``name`` in words: "`pose` (`Rotation`)", "the model (`Net`)" or "the loss function's own code"."""
    if name == LOSS:
        return "the loss function's own code"
    site = sites[name]
    return f"`{name}` (`{site.kind}`)" if name else f"the model (`{site.kind}`)"
