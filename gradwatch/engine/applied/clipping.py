"""The clip coefficient a loop applied, checked against the true norm of the gradient an applied check verified.

An applied check looks at the gradient before clipping: a loop that clips then multiplies it by ``c = min(1,
max_norm / ‖g‖)``, ``‖g‖`` the norm of the whole gradient over every rank and shard (``clip_grad_norm_``, Lightning,
the Trainer and DeepSpeed divide by ``‖g‖ + 1e-6``; both forms are accepted, with the true norm or the norm in the
gradient's own dtype). A norm taken over one rank's shards, before the reduction, or over-counted across a mesh
(VeOmni PR#862) scales every update by the error, which the loss cannot show.

:meth:`GradientNorms.of` records a few numbers of the verified gradient before clipping (no copy);
:func:`check_clipping` holds the gradient the optimizer steps with against them: every tensor the verified one times
the same coefficient, the one ``max_norm`` and the true global norm give, else fault ``"clipping"``. An engine that
clips in its own partitions (DeepSpeed's ZeRO) exposes the norm it clipped with instead
(``engine.optimizer._global_grad_norm``), which :func:`check_clip_norm` checks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradwatch.engine import validation as validate
from gradwatch.engine.numerics.steps import machine_epsilon
from gradwatch.engine.results.findings import AppliedFindings
from gradwatch.engine.results.kinds import Verdict
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import CheckReport

__all__ = ["CLIP_EPSILONS", "GradientNorms", "check_clip_norm", "check_clipping"]

CLIP_EPSILONS = (0.0, 1e-6)
"""What loops add to the norm before dividing ``max_norm`` by it: nothing, or ``1e-6`` (``clip_grad_norm_``,
DeepSpeed)."""

ROUNDING_MULTIPLE = 4.0
"""How many units of the gradient dtype's epsilon a coefficient may be off: the loop computes the norm and the
coefficient in the gradient's dtype and rounds every product (relative ``ε`` each, which the norms average)..."""

LEAST_TOLERANCE = 1e-5
"""... and never less than this: a float32 norm accumulated over millions of elements is off by more than ``4 ε``."""


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a shard's own rows (FSDP2)


def _real(tensor: Tensor) -> Tensor:
    """A complex gradient as its real pairs (the same norm as the moduli the clipping loops take), a real one as it
    is."""
    return torch.view_as_real(tensor.detach().resolve_conj()) if tensor.is_complex() else tensor.detach()


def _norm(tensor: Tensor) -> float:
    """``‖tensor‖`` in float64, over every shard of a DTensor (its own reduction, over its own mesh)."""
    norm = torch.linalg.vector_norm(_real(tensor), dtype=torch.float64)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def _sum(tensor: Tensor) -> tuple[float, float]:
    """The signed sum and the sum of absolute values of this rank's part, in float64."""
    flat = _real(_local(tensor)).reshape(-1).double()
    return float(flat.sum()), float(flat.abs().sum())


def _tensors(name: str, grads: Mapping[str, Tensor | None] | Sequence[Tensor | None]) -> list[Tensor | None]:
    if isinstance(grads, Mapping):
        return list(grads.values())
    if isinstance(grads, (list, tuple)):
        return list(grads)
    raise TypeError(f"`{name}` must be a mapping name -> tensor or a list of tensors; got {type(grads).__name__}")


@dataclass(frozen=True)
class GradientNorms:
    """What :func:`check_clipping` needs of a gradient.

    Attributes:
        norms: ``‖g_T‖`` per tensor over every shard (0 where there is none).
        sums: ``(Σ g_T, Σ |g_T|)`` of this rank's part of each tensor.
        total: ``‖g‖``, the norm of the whole gradient over every tensor, rank and shard.
        dtype: The dtype the gradient is held in (its rounding is the check's tolerance).
        native_total: ``‖g‖`` as ``clip_grad_norm_`` computes it, in the gradient's own dtype (NaN when sharded): a
            correct loop clips with it, and a CPU float32 norm of millions of elements is off by far more than the
            dtype's epsilon (3e-5 at 2M elements, 3e-3 at 40M, one thread).
    """

    norms: tuple[float, ...]
    sums: tuple[tuple[float, float], ...]
    total: float
    dtype: torch.dtype
    native_total: float = math.nan

    @classmethod
    def of(cls, grads: Mapping[str, Tensor | None] | Sequence[Tensor | None]) -> GradientNorms:
        """The norms of ``grads`` (one entry per parameter, ``None`` for none; under FSDP2 the DTensor gradients,
        whose norms cover every shard; under DDP the whole reduced gradient, whose norm is the global one)."""
        tensors = _tensors("grads", grads)
        present = [t for t in tensors if t is not None]
        norms = tuple(_norm(t) if t is not None else 0.0 for t in tensors)
        sums = tuple(_sum(t) if t is not None else (0.0, 0.0) for t in tensors)
        dtype = max((_real(t).dtype for t in present), key=lambda d: machine_epsilon(d), default=torch.float32)
        return cls(norms, sums, math.hypot(*norms), dtype, _native_total(present))


def _native_total(present: list[Tensor]) -> float:
    """The global norm as ``clip_grad_norm_`` takes it: each tensor's norm in its own dtype, then the norm of those."""
    if not present or any(hasattr(t, "to_local") for t in present):
        return math.nan
    device = present[0].device
    norms = [torch.linalg.vector_norm(_real(t)).to(device) for t in present]
    return float(torch.linalg.vector_norm(torch.stack(norms)))


def _expected(total: float, max_norm: float) -> list[float]:
    return [min(1.0, max_norm / (total + eps)) if total + eps > 0 else 1.0 for eps in CLIP_EPSILONS]


def _accepted(norms: GradientNorms, max_norm: float) -> list[float]:
    """The coefficients a correct loop may apply: from the true norm, or from the norm in the gradient's own dtype."""
    totals = [norms.total] + ([norms.native_total] if math.isfinite(norms.native_total) else [])
    return [c for total in totals for c in _expected(total, max_norm)]


def check_clipping(
    verified: GradientNorms | Mapping[str, Tensor | None] | Sequence[Tensor | None],
    clipped: Mapping[str, Tensor | None] | Sequence[Tensor | None],
    max_norm: float,
    *,
    step: int = 0,
) -> CheckReport:
    """Check that the gradient the optimizer steps with, ``clipped``, is the ``verified`` one times
    ``min(1, max_norm / ‖g‖)``, ``‖g‖`` its true global norm (see the module doc).

    Args:
        verified: The gradient before clipping, as the applied check verified it: its :class:`GradientNorms` (recorded
            before the loop clips), or the tensors themselves (copies: clipping changes ``.grad`` in place).
        clipped: The gradient after clipping, in the same order (typically each parameter's ``.grad``).
        max_norm: The loop's clipping threshold (``gradient_clip_val``, ``max_grad_norm``, ``max_norm``).
        step: The optimizer step, recorded on the report.

    Returns:
        A :class:`~gradwatch.CheckReport` with ``scope="applied"`` and no probes: ``"fail"`` with ``fault="clipping"``
        when the coefficient differs from the expected one (or differs between tensors), ``"ok"`` otherwise; a note
        (code ``"applied-clipping"``) gives the norms and both coefficients.
    """
    started = _validated(step, max_norm)
    before = verified if isinstance(verified, GradientNorms) else GradientNorms.of(verified)
    after = GradientNorms.of(clipped)
    if len(after.norms) != len(before.norms):
        raise ValueError(
            f"`clipped` must hold one gradient per tensor of `verified` ({len(before.norms)}); got {len(after.norms)}"
        )
    coarsest = max(before.dtype, after.dtype, key=lambda d: machine_epsilon(d))
    tolerance = max(ROUNDING_MULTIPLE * machine_epsilon(coarsest), LEAST_TOLERANCE)
    expected = _expected(before.total, float(max_norm))
    applied = after.total / before.total if before.total > 0 else 1.0
    wrong = [
        i
        for i, (pre, post, (pre_sum, pre_abs), (post_sum, _)) in enumerate(
            zip(before.norms, after.norms, before.sums, after.sums, strict=True)
        )
        if abs(post - applied * pre) > tolerance * max(post, applied * pre)
        or abs(post_sum - applied * pre_sum) > tolerance * applied * pre_abs + 1e-300
    ]
    coefficient_ok = any(abs(applied - c) <= tolerance * c for c in _accepted(before, float(max_norm)))
    text = (
        f"clipping at max_norm {max_norm:g}: verified gradient norm {before.total:.6g} (over every rank and shard), "
        f"norm after clipping {after.total:.6g}: coefficient {applied:.6g}, expected {expected[0]:.6g}"
    )
    fault_message = ""
    if not coefficient_ok:
        implied = max_norm / applied if applied > 0 else math.inf
        fault_message = (
            f"the gradient was clipped by {applied:.6g} where max_norm {max_norm:g} and its norm {before.total:.6g} "
            f"give {expected[0]:.6g}: the loop clipped as if the norm were {implied:.6g} (a norm over one rank's or "
            f"shard's gradient, before the reduction, or counted twice over a mesh?)"
        )
    elif wrong:
        fault_message = (
            f"{len(wrong)} tensor(s) were not scaled by the common clip coefficient {applied:.6g} (the first: tensor "
            f"{wrong[0]}, norm {before.norms[wrong[0]]:.6g} before, {after.norms[wrong[0]]:.6g} after): clipped "
            "separately, or changed between the check and the optimizer step"
        )
    return _report(step, started, text, fault_message)


def check_clip_norm(verified: GradientNorms, used_norm: float, max_norm: float, *, step: int = 0) -> CheckReport:
    """Check the coefficient ``min(1, max_norm / (used_norm + 1e-6))`` an engine clipped with against the one the true
    norm of the verified gradient gives, for an engine whose clipped gradient :func:`check_clipping` cannot read
    (DeepSpeed's partitions).

    Args:
        verified: The :class:`GradientNorms` of the gradient before clipping, as the applied check verified it (the
            full gradient over every rank: DeepSpeed's ``safe_get_full_grad``).
        used_norm: The norm the engine divided ``max_norm`` by (unscaled by any loss scale).
        max_norm: The engine's clipping threshold (DeepSpeed's ``gradient_clipping``).
        step: The optimizer step, recorded on the report.

    Returns:
        A :class:`~gradwatch.CheckReport` as :func:`check_clipping` returns one.
    """
    started = _validated(step, max_norm)
    if isinstance(used_norm, bool) or not isinstance(used_norm, (int, float)):
        raise ValueError(f"`used_norm` must be a number; got {used_norm!r}")
    tolerance = max(ROUNDING_MULTIPLE * machine_epsilon(verified.dtype), LEAST_TOLERANCE)
    expected = _expected(verified.total, float(max_norm))
    applied = _expected(float(used_norm), float(max_norm))[1] if math.isfinite(used_norm) else 0.0
    text = (
        f"clipping at max_norm {max_norm:g}: verified gradient norm {verified.total:.6g} (over every rank and shard), "
        f"the engine clipped with norm {used_norm:.6g}: coefficient {applied:.6g}, expected {expected[1]:.6g}"
    )
    fault_message = ""
    if not any(abs(applied - c) <= tolerance * c for c in expected):
        fault_message = (
            f"the gradient was clipped by {applied:.6g} where max_norm {max_norm:g} and its norm {verified.total:.6g} "
            f"give {expected[1]:.6g}: the engine clipped with the norm {used_norm:.6g} (a norm over one rank's "
            "partition, before the reduction, or counted twice over a mesh?)"
        )
    return _report(step, started, text, fault_message)


def _validated(step: int, max_norm: float) -> float:
    """The start time of a clipping check whose ``step`` and ``max_norm`` are valid."""
    validate.check_int("step", step, minimum=0)
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"`max_norm` must be a positive number; got {max_norm!r}")
    return time.perf_counter()


def _report(step: int, started: float, text: str, fault_message: str) -> CheckReport:
    """A clipping check's report: no probes, the norms in a note, ``fault == "clipping"`` when there is a message."""
    failed = bool(fault_message)
    findings = AppliedFindings(fault="clipping" if failed else None, fault_message=fault_message)
    return CheckReport(step=step, verdict=Verdict.FAIL if failed else Verdict.OK, probes=[], loss=math.nan, n_forward=0,
                       n_backward=0, duration_s=time.perf_counter() - started,
                       notes=[Note(NoteCode.APPLIED_CLIPPING, text)], scope="applied", applied=findings)  # fmt: skip
