"""Two decisions of a recomputed check taken apart from its measurements: the settings of a check run on shards by
every rank together (:func:`sharded_settings`) and the check's verdict from its probes (:func:`overall_verdict`)."""

from __future__ import annotations

from collections.abc import Sequence

from gradwatch.engine.distributed import SHARDED_NOTE
from gradwatch.engine.distributed.collective import Collective
from gradwatch.engine.function.precision import ResolvedPrecision
from gradwatch.engine.results.kinds import Verdict
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import DESCENT_TARGET, Probe


def sharded_settings(collective: Collective, mode: ResolvedPrecision) -> tuple[list[Note], ResolvedPrecision, bool]:
    """A sharded check's notes, precision and vectorisation: native probes, evaluated one by one."""
    notes = [
        Note(
            NoteCode.SHARDED,
            f"{SHARDED_NOTE} {collective.world} ranks: the global loss (the mean of the ranks' losses) along global "
            "directions, each rank moving its own shards and inputs; probes in the native precision, one point per "
            "forward pass; no input coordinate probes and no culprit search",
        )
    ]
    if mode == "float64":
        why = "FSDP gathers parameters in their own dtype"
        notes.append(Note(NoteCode.SHARDED_NATIVE, f"float64 probes are not made on shards ({why})"))
    return notes, "native", False


def overall_verdict(probes: Sequence[Probe]) -> Verdict:
    """ "fail" if any probe failed; "ok" if a probe of the gradient as a whole or of a tensor agreed; else
    "inconclusive"."""
    if any(p.verdict == Verdict.FAIL for p in probes):
        return Verdict.FAIL
    whole = [p for p in probes if p.index is None and (p.kind.traits.vouches or p.target == DESCENT_TARGET)]
    if any(p.verdict == Verdict.OK for p in whole):
        return Verdict.OK
    return Verdict.INCONCLUSIVE
