"""Whose error is a failing input-gradient probe: the module's own backward, or the gradient reaching its output?

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

from collections.abc import Callable
from typing import Any

from torch import Tensor

from gradwatch.engine.culprits.sites import Displacements, Site, floating

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
