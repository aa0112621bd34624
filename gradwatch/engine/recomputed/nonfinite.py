"""A gradient that is not finite where the loss's derivative is: measured, failed and traced to its module.

``torch.where`` picks the right forward value but back-propagates through both branches, so ``sqrt(0)`` or
``acos(±1)`` in the branch not taken gives ``inf · 0 = NaN`` at the most common input of the domain (kornia's identity
rotation, #3949). Such a gradient fails the check, never "could not run": :func:`measured_nonfinite` measures the
central difference of the loss along the first non-finite entries (finite: the derivative exists and the gradient is
wrong; not finite: the loss itself is not finite around the point, said in a note), lists where it happens, and names
the module at which the gradient turns non-finite (finite output gradient, non-finite input or parameter gradient),
read off every module's boundary in one backward (:func:`~gradwatch.engine.culprits.upstream.turning_point`). A loss
that is not finite at the point itself has no derivative to compare: a note says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from gradwatch.engine.culprits.sites import Site, trace_sites
from gradwatch.engine.culprits.upstream import described, turning_point
from gradwatch.engine.function.evaluation import LossEvaluator, Reference
from gradwatch.engine.numerics.norms import rms
from gradwatch.engine.numerics.steps import machine_epsilon, relative_step
from gradwatch.engine.results.kinds import ProbeKind, Reason, Verdict
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import Probe
from gradwatch.errors import passes_fallbacks

MEASURED_ENTRIES = 2
"""Entries of each tensor at which the central difference is measured (two loss evaluations each)."""

LISTED_ENTRIES = 6
"""Indices listed in the culprit message per tensor, before "and N more"."""


@dataclass
class NonFinite:
    """What :func:`measured_nonfinite` found: the failing probes, the culprit and the notes."""

    probes: list[Probe]
    culprits: list[str] = field(default_factory=list)
    message: str = ""
    notes: list[Note] = field(default_factory=list)


def measured_nonfinite(
    model: nn.Module, evaluator: LossEvaluator, reference: Reference, params: Sequence[tuple[str, Tensor]]
) -> NonFinite:
    """The non-finite findings of a check whose reference ``reference`` has a non-finite loss or gradient (see the
    module doc). ``evaluator`` must be on the native parameters; each entry moved is put back exactly."""
    if not math.isfinite(reference.loss):
        text = (
            f"the loss itself is {reference.loss} at the point: it has no derivative there to compare autograd's "
            "gradient with (a log of 0, a division by 0, an overflow in the forward)"
        )
        probe = Probe(ProbeKind.LOSS, "loss", None, reference.loss, math.nan, math.inf, verdict=Verdict.FAIL,
                      noise=math.nan, step=0.0, reason=Reason.NONFINITE)  # fmt: skip
        return NonFinite([probe], notes=[Note(NoteCode.NONFINITE_LOSS, text)])
    found = NonFinite([])
    for (name, param), grad in zip(params, reference.param_grads, strict=True):
        if grad is None or param.is_complex() or bool(torch.isfinite(grad).all()):
            continue
        for index in _positions(grad)[:MEASURED_ENTRIES]:
            found.probes.append(_measured(evaluator, name, param, index, float(grad[index])))
    where = nonfinite_entries([(name, g) for (name, _), g in zip(params, reference.param_grads, strict=True)])
    if any(not math.isfinite(p.numeric) for p in found.probes):
        text = (
            "the loss is not finite around the point along a tensor whose gradient is not finite: the gradient may "
            "have no finite value to be"
        )
        found.notes.append(Note(NoteCode.NONFINITE_LOSS, text))
    if found.probes:
        measured = all(math.isfinite(p.numeric) for p in found.probes)
        found.culprits, found.message = _culprit(model, evaluator, where, measured, found.notes)
    return found


def nonfinite_entries(named: Sequence[tuple[str, Tensor | None]]) -> str:
    """Where the gradients ``named`` (name, gradient) are not finite, in words: "`pose.axis_angle` at [0, 0], [0, 1]
    and 10 more (12 of 12 entries)"."""
    where = []
    for name, grad in named:
        if grad is None or bool(torch.isfinite(grad).all()):
            continue
        positions = _positions(grad)
        shown = ", ".join(f"[{', '.join(map(str, i))}]" for i in positions[:LISTED_ENTRIES])
        more = f" and {len(positions) - LISTED_ENTRIES} more" if len(positions) > LISTED_ENTRIES else ""
        where.append(f"`{name}` at {shown}{more} ({len(positions)} of {grad.numel()} entries)")
    return "; ".join(where)


def _positions(grad: Tensor) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in row) for row in (~torch.isfinite(grad)).nonzero()]


def _measured(evaluator: LossEvaluator, name: str, param: Tensor, index: tuple[int, ...], analytic: float) -> Probe:
    """The central difference of the loss along entry ``index`` of ``param``, against autograd's non-finite value."""
    data = param.data
    original = data[index].clone()
    size = float(original.abs())
    scale = size if size > 0 else (rms(data) or 1.0)
    step = relative_step(data.dtype) * scale
    values = []
    try:
        for sign in (1.0, -1.0):
            with torch.no_grad():
                data[index] = original + sign * step
            moved = float(data[index]) - float(original)
            values.append((evaluator.loss(), moved))
    finally:
        with torch.no_grad():
            data[index] = original
    (plus, h_plus), (minus, h_minus) = values
    numeric = (plus - minus) / (h_plus - h_minus) if h_plus != h_minus else math.nan
    noise = machine_epsilon(data.dtype) * max(abs(plus), abs(minus)) / max(abs(h_plus), 1e-300)
    return Probe(ProbeKind.PARAM, name, index, analytic, numeric, math.inf, verdict=Verdict.FAIL, noise=noise,
                 step=abs(h_plus), reason=Reason.NONFINITE, evaluations=2)  # fmt: skip


def _culprit(
    model: nn.Module, evaluator: LossEvaluator, where: str, measured: bool, notes: list[Note]
) -> tuple[list[str], str]:
    """The module at which the gradient turns non-finite (:mod:`..culprits.boundaries`), and the finding in words
    (``measured``: the loss's central differences there are finite)."""
    there = "where the loss's central differences are finite" if measured else "(the loss is not finite around it)"
    try:
        sites = trace_sites(model, evaluator)
    except Exception as error:  # the verdict stands without a name
        if passes_fallbacks(error):
            raise
        notes.append(Note(NoteCode.CULPRIT_HOOKS_REFUSED, f"no culprit search: the loss refuses hooks ({error})"))
        return [], f"autograd's gradient is not finite: {where}, {there}"

    def faulty(site: Site, place: str) -> bool:
        return any(not bool(torch.isfinite(g).all()) for g in site.gradients.get(place, []))

    names = turning_point(sites, faulty)
    if not names:
        return [], f"autograd's gradient is not finite: {where}, {there}"
    return names, (
        f"the backward of {described(names[0], sites)} gives a gradient that is not finite while its output gradient "
        f"is finite: {where}, {there} (a torch.where or a mask whose branch not taken is not finite, sqrt(0), "
        "acos(±1), log(0), back-propagates inf · 0 = nan)"
    )
