"""What a check around the optimizer step found besides its probes: the part of the training's path at fault and how its
verdict was calibrated (:class:`AppliedFindings`, a report's ``applied``), and the words for that part (:data:`Fault`).

Plain data, like the rest of :mod:`gradwatch.engine.results`: the applied check (:mod:`gradwatch.engine.applied`), the
clip coefficient's and the update check (:mod:`gradwatch.engine.update`) fill it in; a recomputed check has none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

Fault = Literal[
    "formula", "precision", "compiled", "reduction", "accumulation", "transient", "unknown", "clipping", "modified",
    "update", "gradient",
]  # fmt: skip
"""Which part of the training's path an applied gradient that disagrees with the loss went wrong in: ``"formula"`` (the
eager float32 recomputation is wrong too: a backward formula, a gradient hook), ``"precision"`` (right without autocast,
wrong with it), ``"compiled"`` (right eagerly, wrong through the compiled graph), ``"reduction"`` (the local gradients
are right, the cross-rank reduced one is not, or ranks disagree), ``"accumulation"`` (the window's micro-batch gradients
are right, their sum in the applied gradient is not: leftovers of an earlier window, a micro-batch counted twice or not
at all), ``"transient"`` (the same path computed again gives the right gradient: a one-off corruption), ``"modified"``
(the same path computed again gives the right gradient, and the change recurs: the optimizer runs step pre-hooks, or the
applied check before found the same) or ``"unknown"``; ``"clipping"`` (the gradient the optimizer steps with is not the
verified one times ``min(1, max_norm / ‖g‖)`` with ``‖g‖`` its true global norm:
:func:`~gradwatch.engine.applied.clipping.check_clipping`; for an update check, the update matches the reference from
the unclipped gradient, or from a gradient that is the verified one scaled otherwise). Update checks
(:mod:`gradwatch.engine.update`) also name ``"update"`` (the optimizer's update is not its algorithm's from the verified
gradient and state: a Muon orthogonalising shards, a weight decay applied twice) and ``"gradient"`` (the update is the
algorithm's from another gradient than the verified one: the previous step's, or one changed between the check and the
step)."""

FAULTS: tuple[Fault, ...] = (
    "formula", "precision", "compiled", "reduction", "accumulation", "transient", "unknown", "clipping", "modified",
    "update", "gradient",
)  # fmt: skip
"""Every fault, in the order their codes are written (``gradwatch/applied/fault``: position plus one): new ones last."""


@dataclass(frozen=True, slots=True)
class AppliedFindings:
    """The findings of a check of the applied gradient, of the clip coefficient or of the optimizer's update, nested in
    its report (:attr:`CheckReport.applied <gradwatch.CheckReport.applied>`; ``None`` for a recomputed check). The
    report reads each by its old name too: ``report.fault`` is ``report.applied.fault``.

    Attributes:
        fault: For a failing check, the part of the training's path at fault (see :data:`Fault`); ``None`` when the
            check passed.
        fault_message: The fault in words, with the evidence that named it (``""`` when none).
        noise_floor: The path's noise floor along the descent probe, relative to ``‖g‖`` (how far a correct gradient
            of this precision may be off along it); ``nan`` when not measured.
        floor_excess: The largest ``|analytic − numeric|`` of the check's probes in units of that probe's tolerance
            (its noise floor times the allowed multiple, plus the finite difference's noise); above 1 is a failure.
        accumulation_scale: For several micro-batches: the accumulated gradient's derivative along its own direction
            over that of the gradient of the window's samples taken as one batch (1 when the loss is normalised over
            the window; :mod:`gradwatch.engine.applied.equivalence`), ``nan`` when not compared.
        accumulation_cosine: The cosine of those two gradients (``nan`` when not compared).
    """

    fault: Fault | None = None
    fault_message: str = ""
    noise_floor: float = math.nan
    floor_excess: float = math.nan
    accumulation_scale: float = math.nan
    accumulation_cosine: float = math.nan


FINDINGS: tuple[str, ...] = tuple(f.name for f in fields(AppliedFindings))
"""The names of :class:`AppliedFindings`' fields: the keywords :meth:`gradwatch.engine.session.CheckSession.report`
nests."""
