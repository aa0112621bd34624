"""When an applied check leaves its closer look for a later check: a series' first check, which no budget bounds.

A watch makes its first applied check whatever the budget (it measures what one costs), at step 1 of every run. The
check's combined probes (the descent and the ``"tensors"`` probe, :mod:`.probes`) are about their lower bound; what
can follow them on a healthy model is the **closer look**: the float64 floor measured lazily (:mod:`.lazy_floor`),
the balanced probes over groups and the tensor probes (:mod:`.combined`), called for by a discrepancy above
:data:`~.combined.CLOSER_LOOK` of its tolerance (the common-mode rounding of a float32 CNN at initialisation reaches
that) or by tensors the combined probes do not vouch for. On the CIFAR CNN of ``benchmarks/overhead.py`` that is three
quarters of the first check: 20 training steps of 30.

A check planned without its closer look (:attr:`~.plan.AppliedPlan.closer_look` ``False``) stops after the combined
probes when every one of them **agrees** within its tolerance and no tensor's known rounding is beyond half its own
tolerance (:meth:`~.measured.Rounding.beyond`): the verdict is theirs (a gradient they agree with at the floors they
were judged against agrees with the measured floor too, which only widens every tolerance), and the note
:data:`~gradwatch.engine.results.notes.NoteCode.APPLIED_CLOSER_LOOK_DEFERRED` says what was and was not looked at,
for the watch to make a full check as soon as its budget affords one (:meth:`gradwatch.watch.cadence.Cadence.owe`).
A combined probe that does not agree is never left: the check goes on at once, floor, groups and tensor probes, and a
real fault fails at this check as it would have.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gradwatch.engine.applied.combined import CLOSER_LOOK, unvouched
from gradwatch.engine.applied.measured import Measured, vouchers
from gradwatch.engine.results.notes import Note, NoteCode


def waits(
    measured: Sequence[Measured],
    grad_norms: Sequence[float],
    floors: Sequence[float],
    multiple: float,
) -> bool:
    """Whether a check planned without its closer look stops after the combined probes ``measured``: every one agrees,
    and the closer look would do something (a discrepancy above :data:`~.combined.CLOSER_LOOK` of its tolerance, or
    tensors they do not vouch for)."""
    if not measured or any(m.probe.verdict != "ok" for m in measured):
        return False
    uneasy = any(not m.closer <= CLOSER_LOOK for m in measured)
    return uneasy or bool(unvouched(vouchers(measured), grad_norms, floors, multiple))


def deferred_note(
    measured: Sequence[Measured],
    names: Sequence[str],
    grad_norms: Sequence[float],
    floors: Sequence[float],
    multiple: float,
    *,
    provisional: bool,
) -> Note:
    """What a check that left its closer look (:func:`waits`) looked at and what it did not: its combined probes,
    their largest discrepancy, the floor they were judged against, and the tensors they do not vouch for."""
    worst = max((m.excess for m in measured if math.isfinite(m.excess)), default=math.nan)
    left = unvouched(vouchers(measured), grad_norms, floors, multiple)
    shown = ", ".join(names[i] for i in left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
    kinds = " and ".join(dict.fromkeys(str(m.probe.kind) for m in measured))
    floor = "the storage rounding alone (float64 floor not measured)" if provisional else "the measured floor"
    vouching = (
        f"they vouch for every tensor at its own probe's resolution except {len(left)} of {len(names)} ({shown})"
        if left
        else f"they vouch for all {len(names)} tensors at their own probes' resolution"
    )
    return Note(
        NoteCode.APPLIED_CLOSER_LOOK_DEFERRED,
        f"the run's first applied check made its {kinds} probes only: they agree within their tolerance (largest "
        f"discrepancy {worst:.2f} of it) at {floor}; {vouching}; no tensor was probed one by one. The closer look "
        f"(float64 floor, tensor probes) is made at a later check, when the budget (max_overhead) affords it",
    )


def deferred(notes: Sequence[Note]) -> bool:
    """Whether a check's ``notes`` say it left its closer look for later."""
    return any(getattr(n, "code", None) == NoteCode.APPLIED_CLOSER_LOOK_DEFERRED for n in notes)
