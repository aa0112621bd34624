"""The update check: the update the optimizer applied, against a reference update from the verified gradient.

After ``optimizer.step()``, each tensor kept before it (:class:`~gradwatch.engine.update.snapshot.UpdateSnapshot`) has
moved by ``Δ = new − old``. The reference update ``u`` is the optimizer's algorithm, with its param group's
hyperparameters, computed in float64 on the CPU from the kept values and state and from the gradient the loop should
step with: the verified one (the applied check's) times the declared clip's coefficient. Its **floor** is the same
rule run in the optimizer's own dtypes (and, for Muon, its bfloat16 iteration), rounded to the parameter's dtype: how
far a correct optimizer's update is from ``u`` by rounding alone. ``Δ`` fails when ``‖Δ − u‖`` exceeds
:data:`FLOOR_MULTIPLE` floors (plus a few units of the dtype's epsilon of ``‖u‖``); a floor above
:data:`UNRESOLVED` of ``‖u‖`` (a bfloat16 parameter whose update is below its rounding) leaves the tensor undecided.

A failing update is explained by the gradients it could have been made from: the verified gradient unclipped while
the loop declared a clip, or the ``.grad`` the optimizer was given, scaled otherwise (fault ``"clipping"``); the
gradient of the step before, or a ``.grad`` changed otherwise between the check and the step (``"gradient"``); none
of them: the optimizer's update itself is wrong (``"update"``). An optimizer no rule fits
(:func:`~gradwatch.engine.update.algorithms.reference_for`) is replayed (:mod:`gradwatch.engine.update.replay`), and the
report's note says which reference was used.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from gradwatch.engine import validation as validate
from gradwatch.engine.distributed.whole import whole_value
from gradwatch.engine.function.memory import is_out_of_memory, release_memory
from gradwatch.engine.numerics.steps import machine_epsilon
from gradwatch.engine.results.findings import AppliedFindings
from gradwatch.engine.results.kinds import ProbeKind, Reason, Verdict
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import CheckReport, Fault, Probe
from gradwatch.engine.update.algorithms import reference_for
from gradwatch.engine.update.replay import ReplayError, replayed
from gradwatch.engine.update.snapshot import KeptParameter, UpdateSnapshot

__all__ = ["FLOOR_MULTIPLE", "UNRESOLVED", "check_update"]

FLOOR_MULTIPLE = 4.0
"""How many floors ``‖Δ − u‖`` may reach: the optimizer and the floor's re-run round alike but not identically (the
foreach and fused kernels order their operations otherwise), so a correct update lands about one floor from ``u``."""

ROUNDING_MULTIPLE = 4.0
"""... plus this many units of the parameter dtype's epsilon of ``‖u‖``: a floor that happens to round exactly."""

UNRESOLVED = 0.25
"""A floor above this share of ``‖u‖`` decides nothing: the dtype rounds the update too coarsely to tell it."""

Update = Callable[[Tensor], Tensor]
"""The update a reference makes from a gradient (float64 on the CPU), for the candidates of a failure."""


@dataclass(frozen=True)
class _Compared:
    probe: Probe
    tolerance: float  # relative to ‖u‖
    candidate: Update
    applied: Tensor
    reference: Tensor
    source: str


def _rule_updates(snapshot: UpdateSnapshot, kept: KeptParameter) -> tuple[Update, Tensor, float, str] | None:
    """The float64 update from a gradient, the floor (the distance from the reference of the rule re-run in the
    optimizer's dtypes, rounded to the parameter's) and the reference's name; ``None`` when no rule fits (the
    replay)."""
    reference = reference_for(snapshot.optimizer, kept.hyper)
    if reference is None:
        return None
    dtype = kept.before.dtype
    before64 = kept.before.detach().to("cpu", torch.float64)
    state64 = {
        key: value.detach().to("cpu", torch.float64)
        if isinstance(value, Tensor) and value.is_floating_point()
        else value
        for key, value in kept.state.items()
    }

    def precise(grad: Tensor) -> Tensor:
        new = reference.rule(before64, grad.to("cpu", torch.float64), state64, reference.hyper, precise=True,
                             dtype=dtype)  # fmt: skip
        return new - before64

    clipped = kept.grad.mul(snapshot.coefficient) if snapshot.coefficient != 1.0 else kept.grad
    floors = []
    for variant in reference.variants:
        native = reference.rule(kept.before, clipped, kept.state, {**reference.hyper, **variant}, precise=False,
                                dtype=dtype)  # fmt: skip
        floors.append(native.to(dtype).to("cpu", torch.float64) - before64)
    reference64 = precise(kept.grad.to("cpu", torch.float64) * snapshot.coefficient)
    floor = max(float((update - reference64).norm()) for update in floors)
    iteration = ", its Newton-Schulz iteration in bfloat16" if len(reference.variants) > 1 else ""
    name = f"{reference.name} in float64 (floor: the same rule in {str(dtype).removeprefix('torch.')}{iteration})"
    return precise, reference64, floor, name


def _replay_updates(snapshot: UpdateSnapshot, kept: KeptParameter) -> tuple[Update, Tensor, float, str]:
    before64 = kept.before.detach().to("cpu", torch.float64)

    def replay(grad: Tensor) -> Tensor:
        new = replayed(snapshot.optimizer, kept.before, grad.to(kept.grad.device, kept.grad.dtype), kept.state,
                       kept.hyper)  # fmt: skip
        return new.to("cpu", torch.float64) - before64

    # the replay rounds as the optimizer does: its floor is the rounding of each new value, ε·|new| per element
    eps = machine_epsilon(kept.before.dtype)
    floor_norm = 0.5 * eps * float(kept.before.detach().double().norm())
    dtype = str(kept.before.dtype).removeprefix("torch.")
    name = f"a single-device replay of {type(snapshot.optimizer).__name__} in {dtype}"
    return replay, replay(kept.grad.to("cpu", torch.float64) * snapshot.coefficient), floor_norm, name


def _compare(snapshot: UpdateSnapshot, kept: KeptParameter, lr: float) -> _Compared:
    with torch.no_grad():
        ruled = _rule_updates(snapshot, kept)
        candidate, reference, floor, source = ruled if ruled is not None else _replay_updates(snapshot, kept)
        applied = whole_value(kept.param).detach().to("cpu", torch.float64) - kept.before.to("cpu", torch.float64)
    scale = float(reference.norm())
    eps = machine_epsilon(kept.before.dtype)
    allowed = FLOOR_MULTIPLE * floor + ROUNDING_MULTIPLE * eps * scale
    discrepancy = float((applied - reference).norm())
    finite = math.isfinite(discrepancy) and math.isfinite(scale)
    relative = discrepancy / scale if scale > 0 else (0.0 if discrepancy == 0 else math.inf)
    if not finite:
        verdict, reason = Verdict.FAIL, Reason.NONFINITE
    elif floor > UNRESOLVED * scale:  # within the rounding or not, an update the dtype rounds away vouches for nothing
        verdict, reason = Verdict.INCONCLUSIVE, Reason.UNRESOLVED
    elif discrepancy <= allowed:
        verdict, reason = Verdict.OK, Reason.AGREES
    else:
        verdict, reason = Verdict.FAIL, Reason.DISCREPANCY
    probe = Probe(
        ProbeKind.UPDATE, kept.name, None, analytic=scale, numeric=float(applied.norm()), rel_error=relative,
        verdict=verdict, noise=allowed, step=lr, reason=reason, evaluations=0,
        floor=floor / scale if scale > 0 else math.nan,
    )  # fmt: skip
    return _Compared(probe, allowed / scale if scale > 0 else math.inf, candidate, applied, reference, source)


def _wrong_shares(kept: KeptParameter, compared: _Compared) -> list[int]:
    """The ranks whose share of a sharded tensor (FSDP2's rows, ZeRO's partition) is alone farther from the same
    elements of the reference than the whole tensor's tolerance; ``[]`` where it is not sharded or every share is."""
    difference = (compared.applied - compared.reference).reshape(-1)
    ranks = [rank for rank, (start, count) in enumerate(kept.shares)
             if count and float(difference[start : start + count].norm()) > compared.probe.noise]  # fmt: skip
    return ranks if len(ranks) < len(kept.shares) else []


def _matches(compared: _Compared, grad: Tensor) -> bool:
    """Whether the applied update is the reference's from ``grad``, within the tensor's tolerance."""
    try:
        update = compared.candidate(grad.to("cpu", torch.float64))
    except ReplayError:
        return False
    scale = float(update.norm())
    # the floor is mostly the rounding of the parameters' new values, which does not shrink with a smaller update
    bound = compared.tolerance * max(scale, float(compared.reference.norm()), 1e-300)
    return math.isfinite(scale) and float((compared.applied - update).norm()) <= bound


def _fault(
    snapshot: UpdateSnapshot, kept: KeptParameter, compared: _Compared, given: Tensor | None
) -> tuple[Fault, str]:
    """Which gradient the failing update was made from, and what that means (see the module doc)."""
    verified = kept.grad.to("cpu", torch.float64)
    if snapshot.coefficient < 1.0 and _matches(compared, verified):
        return "clipping", (
            f"it is the update from the verified gradient unclipped, where the declared clip (max_norm "
            f"{snapshot.max_norm:g}, gradient norm {snapshot.norm:.6g}) scales it by {snapshot.coefficient:.6g}: the "
            "clip was not applied to the gradient the optimizer stepped with (clip_grad_norm_ called before "
            "backward(), or on another copy of the gradient)"
        )
    if given is not None:
        given64 = given.detach().to("cpu", torch.float64)
        expected = verified * snapshot.coefficient
        if float((given64 - expected).norm()) > 0 and _matches(compared, given64):
            scale = float((given64 * verified).sum()) / max(float((verified * verified).sum()), 1e-300)
            if float((given64 - scale * verified).norm()) <= 1e-6 * float(given64.norm()):
                return "clipping", (
                    f"it is the update from the verified gradient times {scale:.6g}, where the declared clip gives "
                    f"{snapshot.coefficient:.6g}: the gradient was clipped with another norm than its own"
                )
            return "gradient", (
                "it is the update from the .grad the optimizer held when it stepped, not the verified one: the "
                "gradient was changed between the check and the step (a stale copy, a step pre-hook)"
            )
    previous = snapshot.previous.get(kept.name)
    if previous is not None and _matches(compared, previous):
        return "gradient", (
            "it is the update from the previous step's gradient, not the verified one: the optimizer stepped with a "
            "stale gradient"
        )
    return "update", (
        f"it is not the update {compared.source.split(' in ')[0]} makes from the verified gradient and the optimizer's "
        "own state: the optimizer's update itself is wrong"
    )


UNDECLARED_CLIP_AGREEMENT = 1e-5
"""How closely the factors of an undeclared clip must agree across the kept tensors (and each ``.grad`` be that factor
times its verified gradient, relative to its norm): a norm clip multiplies every gradient by one float32 scalar."""


def _undeclared_clip(snapshot: UpdateSnapshot, given: Mapping[str, Tensor | None] | None) -> float | None:
    """The one factor below 1 by which the loop scaled every kept tensor's verified gradient before the step without
    declaring a clip (``clip_grad_norm_`` called and not told), else ``None``."""
    if snapshot.max_norm is not None or not given or not snapshot.kept:
        return None
    factors = []
    for kept in snapshot.kept:
        grad = given.get(kept.name)
        if grad is None:
            return None
        verified, held = kept.grad.detach().to("cpu", torch.float64), grad.detach().to("cpu", torch.float64)
        square = float((verified * verified).sum())
        if not square > 0:
            return None
        factor = float((held * verified).sum()) / square
        if float((held - factor * verified).norm()) > UNDECLARED_CLIP_AGREEMENT * float(held.norm()):
            return None
        factors.append(factor)
    low, high = min(factors), max(factors)
    if not 0 < low <= high < 1 or high - low > UNDECLARED_CLIP_AGREEMENT * high:
        return None
    return sum(factors) / len(factors)


def check_update(
    snapshot: UpdateSnapshot, *, step: int = 0, given: Mapping[str, Tensor | None] | None = None
) -> CheckReport:
    """Compare the update ``optimizer.step()`` made of each tensor ``snapshot`` kept with the reference update (see the
    module doc). Call after the step (its post hook), before the parameters change again.

    Args:
        snapshot: What was kept before the step (:meth:`UpdateSnapshot.take`).
        step: The optimizer step, recorded on the report.
        given: By name, the ``.grad`` the optimizer stepped with, when still there (a step post hook): a failure whose
            update is the reference's from it is a gradient fault, not the optimizer's.

    Returns:
        A :class:`~gradwatch.CheckReport` with ``scope="update"``, a probe of kind ``"update"`` per tensor (``analytic``
        the norm of the reference update, ``numeric`` the applied one's, ``noise`` the tolerance, ``floor`` the floor
        relative to the reference); ``"fail"`` with a ``fault`` naming the first failing tensor, its cosine and norm
        ratio; a note (code ``"update-reference"``) says which reference each tensor was compared with.
    """
    started = time.perf_counter()
    validate.check_int("step", step, minimum=0)
    probes, notes, failure = [], [], None
    sources: dict[str, list[str]] = {}
    clip = _undeclared_clip(snapshot, given)
    if clip is not None:  # the coefficient a declared clip's max_norm would give: the reference steps with it too
        snapshot = snapshot.with_clip(clip * (snapshot.norm + 1e-6)) if snapshot.norm > 0 else snapshot
        notes.append(Note(NoteCode.UPDATE_UNDECLARED_CLIP, (
            f"the loop scaled the verified gradient by {clip:.6g} before the step, as clip_grad_norm_ does, without "
            "declaring it: the update is checked from the scaled gradient; pass max_norm= to before_optimizer_step "
            "(or call after_clipping) to have the clip coefficient checked too"
        )))  # fmt: skip
    for kept in snapshot.kept:
        lr = float(kept.hyper["lr"]) if isinstance(kept.hyper.get("lr"), (int, float, Tensor)) else math.nan
        try:
            compared = _compare(snapshot, kept, lr)
        except Exception as error:  # a replay it cannot make, or no memory for its float64 comparison
            if not isinstance(error, ReplayError) and not is_out_of_memory(error):
                raise
            release_memory(kept.param.device, error) if is_out_of_memory(error) else None
            notes.append(Note(NoteCode.UPDATE_UNCHECKED, f"the update of `{kept.name}` was not checked: {error}"))
            continue
        probes.append(compared.probe)
        sources.setdefault(compared.source, []).append(kept.name)
        if compared.probe.verdict == Verdict.FAIL and failure is None:
            failure = (kept, compared)
        if compared.probe.reason == Reason.UNRESOLVED:
            notes.append(Note(NoteCode.UPDATE_UNRESOLVED, (
                f"the update of `{kept.name}` is within its dtype's rounding of the reference's (floor "
                f"{compared.probe.floor:.2g} of its norm): {kept.before.dtype} parameters round it too coarsely to tell"
            )))  # fmt: skip
    for source, names in sources.items():
        notes.insert(0, Note(NoteCode.UPDATE_REFERENCE, f"updates of {', '.join(names)} checked against {source}"))
    fault: Fault | None = None
    message = ""
    if failure is not None:
        kept, compared = failure
        grads = given or {}
        fault, why = _fault(snapshot, kept, compared, grads.get(kept.name))
        applied, reference = compared.applied, compared.reference
        norms = float(applied.norm()) * float(reference.norm())
        cosine = float((applied * reference).sum()) / norms if norms > 0 else math.nan
        ratio = compared.probe.numeric / compared.probe.analytic if compared.probe.analytic > 0 else math.inf
        message = (
            f"the update of `{kept.name}` is {compared.probe.rel_error:.3g} off the reference ({compared.source}): "
            f"cosine {cosine:.6g}, norm ratio {ratio:.6g} (applied / reference), where rounding allows "
            f"{compared.tolerance:.2g}; {why}"
        )
        ranks = _wrong_shares(kept, compared)
        if ranks:
            where = (f"rank(s) {ranks} made the part of the update that differs (their shares of `{kept.name}`), the "
                     "other ranks' shares agree with the reference")  # fmt: skip
            message += f"; {where}"
            notes.append(Note(NoteCode.UPDATE_RANKS, where))
    verdicts = [p.verdict for p in probes]
    verdict = (
        Verdict.FAIL if Verdict.FAIL in verdicts else Verdict.OK if Verdict.OK in verdicts else Verdict.INCONCLUSIVE
    )
    floors = [p.floor for p in probes if p.floor is not None and math.isfinite(p.floor)]
    excess = [p.rel_error * p.analytic / p.noise for p in probes if p.noise > 0 and math.isfinite(p.rel_error)]
    return CheckReport(
        step=step, verdict=verdict, probes=probes, loss=math.nan, n_forward=0, n_backward=0,
        duration_s=time.perf_counter() - started, notes=notes, precision="float64", scope="update",
        numerics=snapshot.numerics,
        applied=AppliedFindings(fault=fault, fault_message=message, noise_floor=max(floors) if floors else math.nan,
                                floor_excess=max(excess) if excess else math.nan),
    )  # fmt: skip
