"""The recomputed check a failing applied check runs on its first micro-batch, to name the module at fault.

The applied check measures the gradient the optimizer applies along a few directions: it can say that a formula is
wrong, not where. The recomputed check of the window's first micro-batch, with its culprit search, says where (and
recognises the straight-through estimators whose failures are no fault). A 16-bit model's own gradient hides a few
percent (its check's tolerance is 10%), so its search runs on a float32 twin of the model (:mod:`..function.twin`).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from gradwatch.engine.applied.path import PathSetting
from gradwatch.engine.applied.window import single_loss
from gradwatch.engine.function.twin import TWIN_NOTE, float32_twin, is_sixteen_bit, promoted_batch
from gradwatch.engine.recomputed.check import check_gradients
from gradwatch.engine.recomputed.nonfinite import nonfinite_entries
from gradwatch.engine.results.kinds import Verdict
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import CheckReport
from gradwatch.errors import passes_fallbacks


def recomputed_search(setting: PathSetting, notes: list[Note]) -> CheckReport:
    """The recomputed check of the window's first micro-batch (with its random state), for its culprits and
    surrogates. Whatever it raises leaves an empty ``ok`` report and a note: the applied verdict stands without it (an
    abandoned check is raised on)."""
    session, step = setting.session, setting.session.step
    model, batch = setting.model, setting.batches[0]
    searched = model
    if is_sixteen_bit(model):
        searched, batch = float32_twin(model), promoted_batch(batch)
        notes.append(Note(NoteCode.CULPRIT_FLOAT32_TWIN, TWIN_NOTE))
    budget = setting.search_budget
    if budget is not None:  # the recomputed check the search needs counts against the search's cap
        budget.start()
    try:
        return check_gradients(searched, batch, single_loss(setting.loss_fn, setting.rng_states[0], None), step=step,
                               seed=session.settings.seed, optimizers=session.optimizers,
                               hold_detached=session.settings.hold_detached, search_budget=budget)  # fmt: skip
    except Exception as error:
        if passes_fallbacks(error):
            raise
        text = f"no culprit search: the recomputed check raised {type(error).__name__} ({error})"
        notes.append(Note(NoteCode.CULPRIT_ABANDONED, text))
        return CheckReport(step=step, verdict=Verdict.OK, probes=[], loss=math.nan, n_forward=0, n_backward=0,
                           duration_s=0.0)  # fmt: skip


def nonfinite_fault(setting: PathSetting, applied: list[tuple[str, Tensor]], *, search: bool) -> dict[str, Any]:
    """The fault of an applied gradient that holds non-finite values, as report fields: where (by tensor and index),
    and, with ``search``, the module at which the gradient turns non-finite and the loss's central differences there,
    from the recomputed check of the window's first micro-batch (:mod:`..recomputed.nonfinite`)."""
    found = recomputed_search(setting, []) if search else None
    return {
        "fault": "unknown",
        "fault_message": f"the applied gradient holds non-finite values: {nonfinite_entries(applied)}",
        "culprits": found.culprits if found is not None else [],
        "culprit_message": found.culprit_message if found is not None else "",
    }
