"""What the measuring part of a check produced (:class:`Outcome`), and the verdict of its probes
(:func:`overall_verdict`): one record and one rule for the recomputed and the applied check, whose measurement plans
extend the record (a probe batch, precision and tolerance; floors and attribution) and take their report's common fields
from :meth:`Outcome.report_fields`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.results.kinds import Verdict
from gradwatch.engine.results.report import DESCENT_TARGET, Probe, SearchProgress


def overall_verdict(probes: Sequence[Probe]) -> Verdict:
    """ "fail" if any probe failed; "ok" if a probe of the whole gradient or of a tensor agreed; else "inconclusive"."""
    if any(p.verdict == Verdict.FAIL for p in probes):
        return Verdict.FAIL
    whole = [p for p in probes if p.index is None and (p.kind.traits.vouches or p.target == DESCENT_TARGET)]
    if any(p.verdict == Verdict.OK for p in whole):
        return Verdict.OK
    return Verdict.INCONCLUSIVE


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outcome:
    """What the measuring part of a check produced: its evaluator (notes, counts), the loss at the checked point, the
    finished probes, the culprit of a failure and the surrogate gradients recognised."""

    evaluator: LossEvaluator
    loss: float
    probes: list[Probe]
    culprits: list[str] = dataclasses.field(default_factory=list)
    culprit_message: str = ""
    surrogates: tuple[str, ...] = ()
    culprit_search: SearchProgress | None = None

    def report_fields(self) -> dict[str, Any]:
        """The fields of the check's report (:meth:`CheckSession.report <gradwatch.engine.session.CheckSession.report>`)
        this outcome gives."""
        return {
            "verdict": overall_verdict(self.probes),
            "probes": self.probes,
            "loss": self.loss,
            "notes": self.evaluator.notes,
            "n_forward": self.evaluator.n_forward,
            "culprits": self.culprits,
            "culprit_message": self.culprit_message,
            "surrogates": self.surrogates,
            "culprit_search": self.culprit_search,
        }
