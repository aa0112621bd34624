"""The settings of a recomputed check on sharded parameters (FSDP2, tensor parallelism): native probes of the global
loss, evaluated one point per forward pass, every rank in lockstep."""

from __future__ import annotations

from gradwatch.engine.distributed import SHARDED_NOTE
from gradwatch.engine.distributed.collective import Collective
from gradwatch.engine.function.precision import ResolvedPrecision
from gradwatch.engine.results.notes import Note, NoteCode


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
