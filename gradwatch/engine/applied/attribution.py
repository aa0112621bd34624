"""Which part of the training's path an applied gradient that disagrees with the loss went wrong in.

Any gradient can be held against the failing probes' measurements (:meth:`~.measured.Measured.agrees`) at the cost of
one backward pass, with no new loss evaluation. The attribution recomputes the window's gradient along paths that
differ from the training's in one element at a time:

1. **the same path again** (same micro-batches and random states, gradwatch's own plain mean across ranks). If it is
   right, what the optimizer got is something else: leftovers of an earlier window (the residual has the fingerprint
   of the gradients present when the window began) or another combination of the micro-batch gradients →
   ``"accumulation"``; under DDP the training's own reduction → ``"reduction"``; under FSDP2 the rows of some ranks,
   not all, off → ``"reduction"`` naming them; else the gradient was changed after the backward: ``"modified"`` where
   the change recurs (a step pre-hook that edits ``.grad``, a post-accumulate-grad hook, both named from the first
   check: :func:`step_pre_hooks`, :func:`accumulate_hooks`; a change seen at two checks in a row, :func:`recurring`),
   else ``"transient"`` (once: hardware, a race).
2. the path reproduces the wrong gradient: **eager float32** (today's recomputation) wrong too → ``"formula"``;
3. eager right: the **compiled** code run eagerly under the path's autocast is right → ``"compiled"``; then **autocast
   off** is right → ``"precision"``; else ``"unknown"``.

The probes can say that a formula is wrong, not where: the recomputed check of the window's first micro-batch, with its
culprit search, says where (:func:`recomputed_search`; it also recognises the straight-through estimators whose
failures are no fault). A 16-bit model's own gradient hides a few percent (its check's tolerance is 10%), so its search
runs on a float32 twin of the model (:mod:`..function.twin`).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradwatch.engine.applied import gradients
from gradwatch.engine.applied.measured import Measured
from gradwatch.engine.applied.path import AppliedPlan, CheckedWindow
from gradwatch.engine.applied.split import ranks_at_fault
from gradwatch.engine.applied.window import Checksums, single_loss
from gradwatch.engine.distributed.collective import every_rank
from gradwatch.engine.distributed.zero import ranks_owning_wrong_rows
from gradwatch.engine.function.twin import TWIN_NOTE, float32_twin, is_sixteen_bit, promoted_batch
from gradwatch.engine.numerics.norms import dot, norms, total
from gradwatch.engine.recomputed.check import check_gradients
from gradwatch.engine.recomputed.nonfinite import nonfinite_entries
from gradwatch.engine.results.kinds import Verdict
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import CheckReport, Fault
from gradwatch.errors import passes_fallbacks


@dataclass(frozen=True)
class Attribution:
    """The fault, in words, and whether today's check should search the module whose backward is wrong."""

    fault: Fault
    message: str
    search_culprit: bool = False


def attribute(setting: CheckedWindow, plan: AppliedPlan, eager: list[Tensor], failing: Sequence[Measured],
              floors: Sequence[float], again: list[Tensor] | None = None) -> Attribution:  # fmt: skip
    """The part of the path at fault (see the module doc) for the ``failing`` probes of ``plan``; ``eager`` is eager
    float32 autograd's window gradient, ``again`` the path's, if the check computed it already."""

    def right(grads: list[Tensor]) -> bool:
        return all(probe.agrees(grads, plan.applied) for probe in failing)

    if again is None:
        again = setting.gradient()[1]
    if right(again):
        return _off_the_path(setting, plan, again, floors)
    if not right(eager):
        return Attribution(
            "formula",
            "the eager float32 recomputation disagrees with the loss too: a backward formula or a gradient hook is "
            "wrong, whatever the path",
            search_culprit=True,
        )
    # compiled code may hide in the loss function (a module compiled elsewhere): switching the compiler off is tried
    if right(setting.gradient(compiled=False)[1]):
        return Attribution(
            "compiled",
            "the same path with its compiled code run eagerly gives the right gradient: the compiled graph's "
            "backward is wrong",
        )
    if setting.autocast is not None and right(setting.gradient(with_path=False, compiled=False)[1]):
        dtype = str(setting.autocast).removeprefix("torch.")
        return Attribution(
            "precision",
            f"the same path without {dtype} autocast gives the right gradient: a kernel or backward that runs "
            f"only under {dtype} autocast is wrong",
        )
    return Attribution(
        "unknown",
        "the training's path computes this wrong gradient again, while eager float32 autograd is right, and neither "
        "running compiled code eagerly nor switching autocast off (where they apply) makes it right",
    )


def _off_the_path(
    setting: CheckedWindow, plan: AppliedPlan, again: list[Tensor], floors: Sequence[float]
) -> Attribution:
    """The path recomputes the right gradient: what reached the optimizer was made of something else."""
    applied, multiple = plan.applied, plan.multiple
    residual = [a.double() - b.double() for a, b in zip(applied, again, strict=True)]
    if setting.start is not None and every_rank([_leftover(setting.start, residual, floors, multiple)])[0]:
        return Attribution(
            "accumulation",
            "the applied gradient is the window's gradient plus the gradients that were already there when the window "
            "began (not zeroed between optimizer steps)",
        )
    differing = [(name, p) for (name, p), r, f in zip(setting.session.params, residual, floors, strict=True)
                 if float(r.norm()) > multiple * f]  # fmt: skip
    hooked = accumulate_hooks(differing)
    if hooked:  # before a recombination: a hook rescaling each accumulation also recombines the micro-batches
        return Attribution("modified", accumulate_message(hooked))
    if len(setting.batches) > 1:
        weights = _recombination(setting, plan, floors)
        if weights is not None:
            listed = ", ".join(f"{w:.3g}" for w in weights)
            return Attribution(
                "accumulation",
                f"the applied gradient is another combination of the window's {len(weights)} micro-batch gradients "
                f"(weights {listed}) than the loop's loss",
            )
    if setting.group is not None:
        owners = ranks_owning_wrong_rows(setting.params, applied, again, [multiple * f for f in floors], setting.group)
        if owners:
            return Attribution(
                "reduction",
                f"rank(s) {owners} own the partitions of the applied gradient that differ from the window's gradient "
                "recomputed and averaged by a plain all-reduce, the other ranks' partitions agree (ZeRO: a reduction "
                "that left something out or corrupted those partitions, or a hook that ran on those ranks only)",
            )
        return Attribution(
            "reduction",
            "every rank's own gradient, averaged by a plain all-reduce, is right, while the gradient the training's "
            "cross-rank reduction delivered is not (a communication hook, a missed or corrupted reduction)",
        )
    collective = setting.session.collective
    if collective is not None:
        ranks = ranks_at_fault(collective, applied, again, [multiple * f for f in floors])
        if 0 < len(ranks) < collective.world:
            return Attribution(
                "reduction",
                f"rank(s) {ranks} hold rows of the applied gradient that differ from the same rows recomputed on the "
                "training's path through FSDP's reduce-scatter, the other ranks' rows agree (a skipped or corrupted "
                "reduce-scatter on those ranks, a hook that ran there only)",
            )
    hooks = step_pre_hooks(setting.session.optimizers)
    if hooks:
        return Attribution("modified", modified_message(hooks))
    return Attribution(
        "transient",
        "the same path, run again on the same micro-batches with the same random states, gives the right gradient: the "
        "applied one was corrupted once (hardware, a race, a hook that fired once)",
    )


def _leftover(start: Checksums, residual: list[Tensor], floors: Sequence[float], multiple: float) -> bool:
    """Whether the residual has the fingerprint of the gradients present when the window began, tensor by tensor,
    within the path's floor (``|‖r‖ − ‖s‖| ≤ ‖r − s‖``, ``|Σr − Σs| ≤ √n ‖r − s‖``)."""
    if start.empty or len(start.sums) != len(residual):
        return False
    found = Checksums.of(residual)
    for before, now, floor, tensor in zip(start.sums, found.sums, floors, residual, strict=True):
        slack = multiple * floor
        if abs(math.sqrt(now[2]) - math.sqrt(before[2])) > slack:
            return False
        if abs(now[0] - before[0]) > math.sqrt(max(tensor.numel(), 1)) * slack:
            return False
    return True


def _recombination(setting: CheckedWindow, plan: AppliedPlan, floors: Sequence[float]) -> list[float] | None:
    """The weights ``c`` with ``applied ≈ Σ c_i G_i`` over the micro-batch gradients ``G_i`` recomputed on the path,
    if the applied gradient is such a combination within the path's floor; ``None`` otherwise."""
    applied, multiple = plan.applied, plan.multiple
    micro = []
    for batch, state in zip(setting.batches, setting.rng_states, strict=True):
        loss = single_loss(setting.loss_fn, state, setting.path)
        micro.append(
            gradients.path_gradient(
                setting.model, batch, loss, setting.params, setting.state, group=setting.group, scale=setting.loss_scale
            )[1]
        )
    k = len(micro)
    gram = torch.tensor([[total([dot(a, b) for a, b in zip(micro[i], micro[j], strict=True)]) for j in range(k)]
                         for i in range(k)], dtype=torch.float64)  # fmt: skip
    target = torch.tensor([total([dot(g, a) for g, a in zip(micro[i], applied, strict=True)]) for i in range(k)],
                          dtype=torch.float64)  # fmt: skip
    weights = torch.linalg.lstsq(gram, target.unsqueeze(1)).solution.squeeze(1).tolist()
    residual = [a.double() - sum(w * g[t].double() for w, g in zip(weights, micro, strict=True))
                for t, a in enumerate(applied)]  # fmt: skip
    distance = math.hypot(*norms(residual, exact=True))
    return weights if distance <= multiple * math.hypot(*floors) else None


def recomputed_search(setting: CheckedWindow, notes: list[Note]) -> CheckReport:
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


def nonfinite_fault(setting: CheckedWindow, applied: list[tuple[str, Tensor]], *, search: bool) -> dict[str, Any]:
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


def _global_pre_hooks() -> list[Any]:
    return _theirs(getattr(importlib.import_module("torch.optim.optimizer"), "_global_optimizer_pre_hooks", None))


NOT_THE_USERS = ("gradwatch.", "deepspeed.", "torch.")
"""Where the hooks that are nobody's edit come from: gradwatch's own (a check guards the optimizers with a global
pre-hook), and a parallelising library's, which *are* its reduction (DeepSpeed's ZeRO reduces from a
post-accumulate-grad hook)."""


def _theirs(hooks: Any) -> list[Any]:
    """The hooks someone added to the path (not from :data:`NOT_THE_USERS`)."""
    values = list(hooks.values()) if hasattr(hooks, "values") else []
    return [hook for hook in values if not str(getattr(hook, "__module__", "")).startswith(NOT_THE_USERS)]


def _name(hook: Any) -> str:
    return str(getattr(hook, "__qualname__", None) or type(hook).__qualname__)


def step_pre_hooks(optimizers: Iterable[Any]) -> list[str]:
    """``"Optimizer: hook"`` for each step pre-hook the ``optimizers`` run before their update (global ones as
    ``"every optimizer: hook"``); empty when none."""
    found = [f"every optimizer: {_name(hook)}" for hook in _global_pre_hooks()]
    seen: set[int] = set()
    for optimizer in optimizers:
        raw = getattr(optimizer, "optimizer", optimizer)  # a wrapper (Lightning's, Accelerate's) around the optimizer
        if id(raw) in seen:
            continue
        seen.add(id(raw))
        found += [
            f"{type(raw).__name__}: {_name(hook)}" for hook in _theirs(getattr(raw, "_optimizer_step_pre_hooks", None))
        ]
    return found


def accumulate_hooks(named: Iterable[tuple[str, Any]]) -> list[str]:
    """``"name: hook"`` for each post-accumulate-grad hook on the ``named`` parameters: it runs on the accumulated
    ``.grad`` after each backward, where a recomputation of the path does not, so a hook that rescales it there changes
    the gradient at every step."""
    found = []
    for name, parameter in named:
        found += [f"{name}: {_name(hook)}" for hook in _theirs(getattr(parameter, "_post_accumulate_grad_hooks", None))]
    return found


RIGHT_AGAIN = "the same path, run again on the same micro-batches with the same random states, gives the right gradient"
CHANGED = f"{RIGHT_AGAIN}: the applied one was changed after the backward"


def _listed(hooks: list[str]) -> str:
    return ", ".join(hooks[:4]) + (f" and {len(hooks) - 4} more" if len(hooks) > 4 else "")


def accumulate_message(hooks: list[str]) -> str:
    """The words of a ``"modified"`` fault that post-accumulate-grad hooks on the tensors at fault explain."""
    return (
        f"{CHANGED}, and the tensors that differ have post-accumulate-grad hooks ({_listed(hooks)}), which run on the "
        "accumulated .grad after each backward: a hook that rescales the gradient there changes it at every step"
    )


def modified_message(hooks: list[str]) -> str:
    """The words of a ``"modified"`` fault the optimizers' step pre-hooks explain."""
    return (
        f"{CHANGED}, and the optimizer runs step pre-hooks before its update ({_listed(hooks)}): a hook that edits the "
        "gradient changes it at every step"
    )


def recurring_message(previous_step: int) -> str:
    """The words of a ``"modified"`` fault seen again (the applied check before this one had it too)."""
    return (
        f"{CHANGED}, as at the applied check of step {previous_step}: no one-off corruption but code that edits the "
        "gradient between the backward and the optimizer's update (a step pre-hook, a callback, the loop)"
    )


def recurring(report: CheckReport, previous: tuple[int, str | None] | None) -> CheckReport:
    """``report``, its ``"transient"`` fault called ``"modified"`` when the check before it (``previous``: its step and
    fault, for the same optimizer or window) found one of the two: a change at two checks in a row is no one-off."""
    if report.fault != "transient" or previous is None or previous[1] not in ("transient", "modified"):
        return report
    return report.with_findings(fault="modified", fault_message=recurring_message(previous[0]))
