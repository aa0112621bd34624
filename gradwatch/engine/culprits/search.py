"""Name the module whose backward is wrong: a search along the modules the loss runs, on failing checks only.

A wrong backward makes every gradient upstream of it wrong, so a failing check's probes name the victims. The culprit
is the module at which the gradient turns wrong: its output gradient right, the one it passes to its inputs (or gives
its own parameters) not. Activation probes (:mod:`.sites`) measure that, one place of one module at a time, with the
verdict discipline of every probe.

The search descends the call tree from the loss (:func:`localize`). At each module whose output gradient is right and
whose input gradient is wrong, the gradient at its children's outputs, in the order the forward ran them, is wrong up to
some child and right from the next on (the error flows backwards): a binary search finds the boundary:

* the first child whose output gradient is right, but whose input gradient is wrong, contains the bug: descend into it;
* if its input gradient is right too, the gradient turns wrong between two children, in the module's own code (a
  ``.detach()`` or a custom ``autograd.Function`` in its ``forward``): the module is the culprit;
* if every child's output gradient is wrong, the module's own code after its last child is (at the top, :data:`LOSS`);
* if only parameters' gradients are wrong, the module owning them is the culprit if a probe of its parameters,
  displaced during its own forward only, fails (a wrong weight gradient, a gradient hook); else the parameters are
  used outside their modules by code whose gradient is missing. A parameter whose module never runs counts as one of
  the module whose forward reads it (:mod:`.reads`).

A module is proved to hold the bug by its input gradient only when its backward disagrees with its forward along the
probed direction (:mod:`.activations`), not merely passes on a wrong gradient its output probe was too weak to see;
when that split finds the failure downstream's, the module is a victim whatever its output probes said, and the
boundary lies after it. Where a probe the descent needs cannot decide (a bug's share of a gradient many modules feed),
the modules inside the deepest one proved are probed, breadth first, for one that proves the bug inside it by its own
input gradient (``Descent._sweep`` in :mod:`.descent`).

``report.culprits`` lists the culprit and the modules proven to contain it, most specific first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from gradwatch.engine.culprits.activations import ActivationProbes
from gradwatch.engine.culprits.descent import Descent
from gradwatch.engine.culprits.sites import Site, trace_sites
from gradwatch.engine.culprits.words import LOSS, Localization
from gradwatch.engine.culprits.writes import Write, writes_behind_autograds_back
from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.function.precision import probe_precision
from gradwatch.engine.measuring.points import Measurements
from gradwatch.engine.numerics.steps import machine_epsilon
from gradwatch.engine.probing.ladder import Ladder
from gradwatch.engine.probing.portfolio import Portfolio
from gradwatch.engine.probing.search_budget import SearchBudget
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.recomputed.faithfulness import UnfaithfulFloat64Error
from gradwatch.engine.recomputed.reference import reproduced_center
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.errors import passes_fallbacks

LadderFactory = Callable[[Measurements, float], Ladder]


def localize(
    model: nn.Module,
    evaluator: LossEvaluator,
    portfolio: Portfolio,
    tasks: Sequence[ProbeTask],
    ladder: LadderFactory,
    precision: str,
    *,
    budget: SearchBudget | None = None,
) -> Localization | None:
    """Search for the culprit of a failing check (see the module doc); ``None`` when the check did not fail on a
    gradient probe. ``evaluator`` is on the native parameters and inputs, before and after. ``budget``: the cap on
    what the search spends and where an earlier check's search left off."""
    failing = [
        t
        for t in tasks
        if t.failed
        and t.kind.traits.starts_culprit_search
        and t.result is not None
        and t.result.reason != "imprecise"  # rounding of a correct formula (fail_on_imprecise): no backward to name
    ]
    if not failing:
        return None
    found = Localization()
    if budget is not None:
        budget.start()
    written = _written(model, evaluator)
    if written is not None:
        found.culprits, found.message = written.culprits, written.message
        return found
    sites = _sites(model, evaluator, found)
    if sites is None:
        return found
    if not sites:
        found.notes.append(Note(NoteCode.CULPRIT_NO_MODULE, "no culprit search: the loss runs no module"))
        return found
    failing_params = {t.target for t in failing if t.kind.traits.one_tensor}
    try:
        with probe_precision(model, evaluator, precision) as (_, trial):
            native = portfolio.native_dtype
            compute = max((p.dtype for _, p in evaluator.params), key=machine_epsilon)
            reproduced = reproduced_center(evaluator, portfolio.reference, trial, native, compute)
            if reproduced is None:
                return found
            measurements = Measurements(evaluator, *reproduced)
            probes = ActivationProbes(
                sites, ladder(measurements, portfolio.reference.loss), portfolio, compute, frozenset(failing_params),
                budget,
            )  # fmt: skip
            found.tasks = probes.tasks  # the same list: filled as the search measures
            Descent(sites, probes, failing_params, found, budget).run()
    except UnfaithfulFloat64Error as error:
        found.notes.append(
            Note(
                NoteCode.CULPRIT_FLOAT64_UNFAITHFUL, f"no culprit search: float64 evaluates another function ({error})"
            )
        )
    except Exception as error:  # the search must never cost the check its verdict
        if passes_fallbacks(error):
            raise
        found.culprits, found.message = [], ""
        found.tasks = [task for task in found.tasks if task.result is not None]  # the probe it raised in is not one
        found.notes.append(
            Note(
                NoteCode.CULPRIT_ABANDONED,
                f"culprit search abandoned: the loss raised {type(error).__name__} under its hooks ({error})",
            )
        )
    return found


def _written(model: nn.Module, evaluator: LossEvaluator) -> Write | None:
    """The module that wrote behind autograd's back (the writer, not the first victim, is at fault), ``None`` where none
    did or the loss refuses saved-tensor hooks."""
    try:
        return writes_behind_autograds_back(model, evaluator)
    except Exception as error:
        if passes_fallbacks(error):
            raise
        return None


def _sites(model: nn.Module, evaluator: LossEvaluator, found: Localization) -> dict[str, Site] | None:
    """The modules the loss runs (:func:`trace_sites`); ``None``, with a note in ``found``, when it refuses the
    hooks."""
    try:
        return trace_sites(model, evaluator)
    except Exception as error:
        if passes_fallbacks(error):
            raise
        refused = f"no culprit search: the loss cannot run with hooks on its modules ({error})"
        found.notes.append(Note(NoteCode.CULPRIT_HOOKS_REFUSED, refused))
        return None


__all__ = ["LOSS", "Localization", "localize"]
