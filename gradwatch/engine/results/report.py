"""Results of a gradient check: one :class:`Probe` per finite-difference measurement, one :class:`CheckReport` per
check.

These are plain data. The engine fills them in, and the callback, the TensorBoard writer and the alerts read them;
nothing here computes a verdict.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import KW_ONLY, dataclass, field
from enum import Enum
from typing import Any, Literal, TypeVar

from gradwatch.engine.results.findings import FAULTS as FAULTS
from gradwatch.engine.results.findings import AppliedFindings
from gradwatch.engine.results.findings import Fault as Fault
from gradwatch.engine.results.kinds import ProbeKind, Reason, Verdict
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.numerics import Numerics
from gradwatch.errors import CheckAbandonedError as CheckAbandonedError
from gradwatch.errors import GradientCheckError as GradientCheckError
from gradwatch.errors import UnrestoredStateWarning as UnrestoredStateWarning

VERDICTS: tuple[Verdict, ...] = tuple(Verdict)
"""All verdicts, in order of severity (the logged ``gradwatch/verdict`` scalar is the position in this tuple)."""

UNDECIDED_REASONS: tuple[Reason, ...] = tuple(reason for reason in Reason if reason.retried)
"""Why a probe may end undecided where the next check, at another point, could decide."""

Scope = Literal["applied", "recomputed", "update"]
"""What a check compared: ``"update"``, the update the optimizer applied against a reference update computed from the
verified gradient (:mod:`gradwatch.engine.update`); ``"applied"``, the gradient the optimizer is about to apply, as the
training's own path computed it (autocast, compiled graph, accumulation, cross-rank reduction, hooks;
:mod:`gradwatch.engine.applied`); ``"recomputed"``, gradwatch's own eager float32 recomputation on a slice of one batch
(:func:`~gradwatch.engine.recomputed.check.check_gradients`)."""

_E = TypeVar("_E", bound=Enum)


@dataclass(frozen=True)
class SearchProgress:
    """How far a culprit search got (:attr:`CheckReport.culprit_search`), and where a series of checks resumes it
    (:mod:`gradwatch.engine.probing.search_budget`).

    Attributes:
        complete: Whether the search ended by its own logic (a culprit named, or no module to single out); ``False``
            when its cap or its limit of probes stopped it.
        within: The modules proved to hold the bug, outermost first (where the next search resumes).
        candidates: The modules inside the deepest of them among which the bug still lies (its children the search was
            narrowing, in the order the forward runs them); all its children where it had not started narrowing.
        resumed: Whether the search resumed where an earlier check's stopped.
        evaluations: The loss evaluations the search spent in this check.
    """

    complete: bool
    within: tuple[str, ...] = ()
    candidates: tuple[str, ...] = ()
    resumed: bool = False
    evaluations: int = 0

    def resume_point(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(within, candidates)`` where the next search goes on: inside the deepest module proved, among the
        candidates left; after a complete search, inside the culprit it named (the next failing check proves it
        again and names it for a fraction of a whole search, or starts over where it no longer holds the bug)."""
        return (self.within, ()) if self.complete else (self.within, self.candidates)


DESCENT_TARGET = "*"
"""The ``target`` of the descent probe, which moves every trainable parameter at once."""


@dataclass(frozen=True, slots=True)
class Probe:
    """One comparison between an analytic (autograd) derivative and a finite-difference estimate of it.

    Attributes:
        kind: What was perturbed (a :class:`~gradwatch.engine.results.kinds.ProbeKind`, a ``str``: ``probe.kind ==
            "tensor"``).
        target: The parameter name as in ``named_parameters()``, an input path such as ``"batch[0]"`` or
            ``"batch['x']"``, ``"*"`` for the descent probe, or ``"loss"``.
        index: The perturbed coordinate within ``target``, or ``None`` for a probe along a direction.
        analytic: The derivative computed by autograd along the probe's direction (for the descent probe: ``‖g‖``).
        numeric: The derivative measured by finite differences of the loss.
        rel_error: ``|numeric − analytic| / max(|numeric|, |analytic|)``, with the denominator floored at the size a
            derivative of the probed tensor can be expected to have, so that a derivative whose true value is zero does
            not read as a 100% error.
        verdict: ``"ok"``, ``"fail"`` or ``"inconclusive"`` (a :class:`~gradwatch.engine.results.kinds.Verdict`, a
            ``str``).
        noise: The probe's estimate of the absolute error of ``numeric`` (round-off, truncation and the jitter of
            non-deterministic kernels), in the same units. A screen borrows it from the check's descent probe.
        step: The finite-difference step actually used (in units of the perturbed value; for a direction, the length
            of the step along it).
        reason: Why the verdict is what it is: ``"agrees"``, ``"discrepancy"``, ``"missing"``, ``"kink"``,
            ``"surrogate"`` (a straight-through estimator, see :attr:`CheckReport.surrogates`), ...: a
            :class:`~gradwatch.engine.results.kinds.Reason`, whose members say what each means.
        evaluations: Loss evaluations this probe spent: 2 for a screen that settled it, 4 for a full stencil, 8 with
            a confirmation at a second step, more when it was measured again in float64.
        floor: Applied checks only: the noise floor of the training's path along the probe's direction, in derivative
            units (how far a correct gradient computed on that path may be off); the probe fails when ``|analytic −
            numeric|`` exceeds a multiple of it plus the finite difference's own noise. ``None`` otherwise.
    """

    kind: ProbeKind
    target: str
    index: tuple[int, ...] | None
    analytic: float
    numeric: float
    rel_error: float
    _: KW_ONLY
    verdict: Verdict
    noise: float
    step: float
    reason: Reason
    evaluations: int = 0
    floor: float | None = None

    def __post_init__(self) -> None:
        # the enums, from the strings older code and users pass: the properties of a kind are then `probe.kind.traits`
        object.__setattr__(self, "kind", _member(ProbeKind, self.kind, "kind"))
        object.__setattr__(self, "verdict", _member(Verdict, self.verdict, "verdict"))
        object.__setattr__(self, "reason", _member(Reason, self.reason, "reason"))

    @property
    def location(self) -> str:
        """``target[index]`` as a user would type it, e.g. ``"fc.weight[3, 7]"``; ``"*"`` for the descent probe."""
        if self.index is None:
            return self.target or "(the model)"
        return f"{self.target}[{', '.join(str(i) for i in self.index)}]"

    @property
    def conclusive(self) -> bool:
        """Whether the probe could tell a correct derivative from a wrong one."""
        return self.verdict != Verdict.INCONCLUSIVE

    def describe(self) -> str:
        """One line naming where the probe looked, both derivatives and the verdict (for a loss probe, the loss's
        value: only a loss that is not finite is reported)."""
        if self.kind == ProbeKind.LOSS:
            return f"loss: {self.analytic:.6g} at the checked point -> {self.verdict} ({self.reason})"
        return (
            f"{self.kind} {self.location}: analytic {self.analytic:.6g}, numeric {self.numeric:.6g} "
            f"(± {self.noise:.2g}), rel. error {self.rel_error:.3g} -> {self.verdict} ({self.reason})"
        )


@dataclass(frozen=True, slots=True)
class CheckReport:
    """The result of one gradient check.

    Attributes:
        step: The training step the check ran at (the optimizer step count in the callback).
        verdict: ``"fail"`` if any probe failed; ``"ok"`` if none failed and the descent probe (or, without one, at
            least one probe) agreed; ``"inconclusive"`` otherwise.
        probes: Every probe of the check, descent probe first.
        loss: The loss at the checked point, as autograd computed it.
        n_forward: Loss evaluations spent (the reference pass included).
        n_backward: Backward passes spent (one: the reference gradient).
        duration_s: Wall time of the check in seconds.
        notes: Human-readable remarks on what was skipped or degraded, e.g. an input that receives no gradient: each a
            :class:`~gradwatch.engine.results.notes.Note`, a ``str`` with a stable ``code`` (see :meth:`noted`).
        samples: How many samples of the batch the probes used (``None`` when the batch has no tensor).
        precision: What the probes evaluated the loss in: ``"native"`` (the parameters' dtype) or ``"float64"``.
        rtol: The relative tolerance the probes were judged with: the one asked for, raised where the loss is so
            small that autograd's own rounding exceeds it (about ``4 ε / |loss|``).
        n_passes: Forward passes the loss evaluations took (the reference pass included): fewer than ``n_forward``
            where points were evaluated together (:mod:`gradwatch.vectorized`).
        vectorized: Whether the probes' points were evaluated together in vectorised passes: ``True`` if they were,
            ``False`` if a vectorised pass failed, ``None`` if none was tried (native precision, ``vectorize=False``,
            a loss vmap refuses as its reference pass showed, or no group of points fitted a pass's memory): notes say.
        side_effects: What the loss changed in the model's state besides parameters and buffers (``"outputs"``,
            ``"train_acc.tp"``), which the check put back after every evaluation
            (:mod:`gradwatch.engine.function.sandbox`).
        unrestored: What the loss changed that the check could not put back (a tensor changed in place of which no
            copy was kept): the run is not exactly as it would have been without the check.
        surrogates: Gradients that are deliberately not the derivative, recognised by their signature (a
            straight-through estimator, a stop-gradient), each in words with the ``ignore=`` pattern that exempts it
            (:mod:`gradwatch.engine.recomputed.signatures`).
        culprits: For a failing check, the module whose backward is wrong, followed by the modules proven to contain
            it, most specific first (names as in ``model.named_modules()`` of the checked model, ``""`` the model
            itself, ``"<loss>"`` the loss function's own code); empty when the check passed or no module could be
            singled out (:mod:`gradwatch.engine.culprits`).
        culprit_message: The culprit in words: ``"the backward of `blocks[0].norm` (`RMSNorm`) is wrong: its input
            gradient is 2.7% off while its output gradient is right"``.
        scope: ``"applied"``, ``"recomputed"`` or ``"update"``: what the check compared (see :data:`Scope`).
        applied: What a check of the applied gradient, of the clip coefficient or of the update found besides its
            probes: the fault and how the verdict was calibrated (an :class:`AppliedFindings`); ``None`` for a
            recomputed check. Its fields read as the report's own too (``report.fault``, ``report.noise_floor``, ...:
            their defaults, ``None``, ``""`` or ``nan``, without findings).
        probed_inputs: The paths of the batch's floating inputs the check differentiated and could probe
            (``"batch[0]"``, ``"batch.x"``); the notes say why any other floating input was not (the loss refuses inputs
            that require grad, or detaches them).
        numerics: The settings that change the numbers, as training had them when the check started (TF32, reduced
            reductions, deterministic algorithms, attention backends, autocast; see
            :mod:`gradwatch.engine.results.numerics`).
        culprit_search: How far a failing check's culprit search got (a
            :class:`SearchProgress`: complete, or stopped at its cap where the
            next check of a series goes on); ``None`` where no search ran.
    """

    step: int
    verdict: Verdict
    probes: list[Probe]
    loss: float
    n_forward: int
    n_backward: int
    _: KW_ONLY
    duration_s: float
    notes: list[Note] = field(default_factory=list)
    samples: int | None = None
    precision: str = "native"
    rtol: float = math.nan
    n_passes: int = 0
    vectorized: bool | None = None
    side_effects: tuple[str, ...] = ()
    unrestored: tuple[str, ...] = ()
    surrogates: tuple[str, ...] = ()
    culprits: list[str] = field(default_factory=list)
    culprit_message: str = ""
    scope: Scope = "recomputed"
    applied: AppliedFindings | None = None
    probed_inputs: tuple[str, ...] = ()
    numerics: Numerics | None = None
    culprit_search: SearchProgress | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", _member(Verdict, self.verdict, "verdict"))

    def noted(self, code: NoteCode | str) -> list[Note]:
        """The notes with ``code``, in order: ``report.noted("sharded")`` is the note of a sharded check, ``[]`` if it
        was not sharded.

        Args:
            code: A :class:`~gradwatch.engine.results.notes.NoteCode` or its value.
        """
        return [note for note in self.notes if getattr(note, "code", None) == code]

    @property
    def _findings(self) -> AppliedFindings:
        """The applied findings, or the empty ones (every field at its default) for a recomputed check."""
        return self.applied if self.applied is not None else _NO_FINDINGS

    @property
    def fault(self) -> Fault | None:
        """The part of the training's path at fault (:attr:`AppliedFindings.fault`); ``None`` without one."""
        return self._findings.fault

    @property
    def fault_message(self) -> str:
        """The fault in words (:attr:`AppliedFindings.fault_message`); ``""`` without one."""
        return self._findings.fault_message

    @property
    def noise_floor(self) -> float:
        """The path's noise floor along the descent probe (:attr:`AppliedFindings.noise_floor`); ``nan`` without one."""
        return self._findings.noise_floor

    @property
    def floor_excess(self) -> float:
        """The largest discrepancy in units of its tolerance (:attr:`AppliedFindings.floor_excess`); ``nan`` without."""
        return self._findings.floor_excess

    @property
    def accumulation_scale(self) -> float:
        """The accumulated over the one-batch gradient (:attr:`AppliedFindings.accumulation_scale`); ``nan`` without."""
        return self._findings.accumulation_scale

    @property
    def accumulation_cosine(self) -> float:
        """The cosine of those two gradients (:attr:`AppliedFindings.accumulation_cosine`); ``nan`` without."""
        return self._findings.accumulation_cosine

    def with_findings(self, **changes: Any) -> CheckReport:
        """This report with fields of its applied findings replaced (from the empty findings when it has none):
        ``report.with_findings(fault="modified", fault_message=...)``.

        Args:
            changes: New values of :class:`AppliedFindings`' fields, by name.
        """
        return dataclasses.replace(self, applied=dataclasses.replace(self._findings, **changes))

    @property
    def failures(self) -> list[Probe]:
        """The failing probes, in the order they were run."""
        return [p for p in self.probes if p.verdict == Verdict.FAIL]

    @property
    def descent(self) -> Probe | None:
        """The descent probe, or ``None`` when the check had none (no trainable parameter with a gradient)."""
        return next((p for p in self.probes if p.kind == ProbeKind.DESCENT), None)

    @property
    def descent_ratio(self) -> float:
        """Measured over predicted loss decrease for a small step along ``−ĝ``: 1 for a correct gradient, −1 for a
        sign-flipped one, 0.9 for one 11% too large. ``nan`` when there is no descent probe."""
        probe = self.descent
        if probe is None or probe.analytic == 0.0:
            return math.nan
        return probe.numeric / probe.analytic

    @property
    def undecided(self) -> tuple[str, ...]:
        """Tensors whose probe along their own gradient could not decide (kinks, noise, an unstable discrepancy): a
        series of checks probes them again next time (``check_gradients(..., focus=report.undecided)``)."""
        names = (
            p.target
            for p in self.probes
            if p.kind.traits.refocused and p.verdict == Verdict.INCONCLUSIVE and p.reason in UNDECIDED_REASONS
        )
        return tuple(dict.fromkeys(names))

    @property
    def failed_tensors(self) -> tuple[str, ...]:
        """Tensors whose probe along their own gradient failed, the largest relative error first: a series of checks
        probes them again next time, so that a wrong gradient found once is confirmed (or cleared) at every check
        rather than when its turn comes round again."""
        failed = [p for p in self.probes if p.kind.traits.refocused and p.verdict == Verdict.FAIL and p.index is None]
        failed.sort(key=lambda p: -p.rel_error if math.isfinite(p.rel_error) else -math.inf)
        return tuple(dict.fromkeys(p.target for p in failed))

    def count(self, verdict: Verdict | str) -> int:
        """How many probes ended with ``verdict``.

        Args:
            verdict: ``"ok"``, ``"fail"`` or ``"inconclusive"``.
        """
        return sum(p.verdict == verdict for p in self.probes)

    @property
    def noise_levels(self) -> list[float]:
        """Each conclusive probe's noise relative to its derivative's scale: how small an error it could have seen."""
        return [
            p.noise / max(abs(p.analytic), abs(p.numeric))
            for p in self.probes
            if p.conclusive and max(abs(p.analytic), abs(p.numeric)) > 0 and math.isfinite(p.noise)
        ]

    @property
    def conclusive_rel_errors(self) -> list[float]:
        """Relative errors of the probes that could tell right from wrong (inconclusive probes measure noise)."""
        return [p.rel_error for p in self.probes if p.conclusive]

    def summary(self) -> str:
        """One line: step, verdict (led by the fault for a failing applied check), counts, worst relative error and the
        descent ratio."""
        errors = self.conclusive_rel_errors
        worst = f"{max(errors):.2g}" if errors else "n/a"
        where = "the optimizer's update" if self.scope == "update" else "the applied gradient"
        lead = f"{self.fault} fault in {where}; " if self.fault is not None else ""
        scope = f"{self.scope} " if self.scope != "recomputed" else ""
        return (
            f"{lead}{scope}step {self.step}: {self.verdict} ({len(self.probes)} probes: {self.count('ok')} ok, "
            f"{self.count('fail')} fail, {self.count('inconclusive')} inconclusive; max rel. error {worst}; "
            f"descent ratio {self.descent_ratio:.6g}; {self.n_forward} loss evaluations in {self.n_passes} forward "
            f"passes, {self.n_backward} backward, {self.duration_s * 1e3:.0f} ms)"
        )

    def scalars(self) -> dict[str, float]:
        """The fixed set of numbers gradwatch logs for a check, keyed by tag (see the README for each tag)."""
        errors = self.conclusive_rel_errors
        noise = self.noise_levels
        return {
            "gradwatch/rel_error_max": max(errors) if errors else math.nan,
            "gradwatch/rel_error_median": statistics.median(errors) if errors else math.nan,
            "gradwatch/rel_error_min": min(errors) if errors else math.nan,
            "gradwatch/descent_ratio": self.descent_ratio,
            "gradwatch/failing_probes": float(self.count("fail")),
            "gradwatch/inconclusive_probes": float(self.count("inconclusive")),
            "gradwatch/verdict": float(VERDICTS.index(self.verdict)),
            "gradwatch/check_seconds": self.duration_s,
            "gradwatch/loss_evaluations": float(self.n_forward),
            "gradwatch/forward_passes": float(self.n_passes),
            "gradwatch/noise_median": statistics.median(noise) if noise else math.nan,
        }

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.fault_message:
            lines.append(f"  fault: {self.fault_message}")
        if self.culprit_message:
            lines.append(f"  culprit: {self.culprit_message}")
        lines += [f"  {p.describe()}" for p in self.probes]
        lines += [f"  surrogate: {finding}" for finding in self.surrogates]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


_NO_FINDINGS = AppliedFindings()


def _member(enum: type[_E], value: str, argument: str) -> _E:
    """``value`` as a member of ``enum``, naming the argument and the choices when it is none."""
    try:
        return enum(value)
    except ValueError:
        choices = ", ".join(repr(member.value) for member in enum)
        raise ValueError(f"`{argument}` must be one of {choices}; got {value!r}") from None
