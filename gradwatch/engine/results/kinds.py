"""The names a check reports, as enums, and what the engine does with each probe kind, in one table.

:class:`ProbeKind`, :class:`Verdict` and :class:`Reason` are ``str``-valued enums: a member *is* its value
(``Verdict.FAIL == "fail"``, ``f"{ProbeKind.DESCENT}" == "descent"``, JSON writes ``"fail"``), so reports compare,
print and serialise as they did when these were plain strings.

:data:`PROBE_KINDS` holds each kind's properties (:class:`KindTraits`), read through ``kind.traits``: the engine asks
them (``task.kind.traits.moves_inputs``) instead of listing kind names.

Adding a probe kind of the parameters is a member of :class:`ProbeKind` (its value is what reports show), its row in
:data:`PROBE_KINDS`, whose properties say where the rest of the engine takes the new probes in, and the portfolio
method named by the row's ``made_by`` (``docs/kinds-and-notes.md`` says how; ``tests/engine/test_new_kind.py`` adds
one). ``tests/engine/test_kinds.py`` checks that every kind has a row, that no other module spells kind names, and that
``docs/kinds-and-notes.md`` lists the row.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from enum import Enum


class StrEnum(str, Enum):
    """An enum whose members are strings that print, format and show as their value (``enum.StrEnum``, which Python
    3.10 lacks; its ``repr`` too, so that reports and doctests read as they did with plain strings)."""

    def __repr__(self) -> str:
        return str.__repr__(self)

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, format_spec: str) -> str:
        return str.__format__(str(self), format_spec)


class ProbeKind(StrEnum):
    """What a probe moves (:attr:`gradwatch.engine.results.report.Probe.kind`); each kind's meaning and properties are
    its row of :data:`PROBE_KINDS`. The culprit search's kinds (``"activation"``, ``"module_input"``,
    ``"module_params"``) have as ``target`` a module's name as in ``named_modules()`` (``""``: the model itself); for
    ``"compiled"`` and ``"update"``, ``analytic`` and ``numeric`` are norms and ``rel_error`` their difference's norm
    relative to the larger (:mod:`gradwatch.engine.recomputed.compiled`) or to the reference update's
    (:mod:`gradwatch.engine.update`)."""

    DESCENT = "descent"
    COVER = "cover"
    TENSOR = "tensor"
    TENSORS = "tensors"
    RANDOM = "random"
    PARAM = "param"
    INPUT = "input"
    LOSS = "loss"
    COMPILED = "compiled"
    UPDATE = "update"
    ACTIVATION = "activation"
    MODULE_INPUT = "module_input"
    MODULE_PARAMS = "module_params"

    @property
    def traits(self) -> KindTraits:
        """This kind's row of :data:`PROBE_KINDS`."""
        return PROBE_KINDS[self]


@dataclass(frozen=True)
class KindTraits:
    """What the engine does with the probes of one kind.

    Attributes:
        meaning: What the probe measures, in words.
        moves_parameters: It moves the model's trainable parameters themselves: an undecided native probe is measured
            again on float64 copies of them (:meth:`Ladder.remeasure_in_float64
            <gradwatch.engine.probing.ladder.Ladder.remeasure_in_float64>`).
        moves_inputs: It moves the batch's floating inputs: the evaluations that measure it again need the gradient
            with respect to the inputs, and it is made through the input paths of the portfolio.
        one_tensor: It is measured within one parameter tensor (its ``target`` the parameter's name, unless it is the
            random anchor ``"*"``): the signatures of surrogate gradients judge such probes per tensor, and a failing
            one names a parameter whose module the culprit search must reach.
        vouches: Along its direction (``index`` ``None``), agreement suffices for the check's ``"ok"``: the gradient
            as a whole, a tensor's gradient, the inputs' gradient (a random direction or a coordinate does not).
        starts_culprit_search: A failure of it is a wrong gradient that the culprit search looks for the module of.
        culprit_search: It is a probe of the culprit search (one place of one module): it locates the failing
            probes' culprit and is no victim itself (listings of what failed leave it out).
        refocused: An undecided probe of it (see :attr:`Reason.retried`) names its tensor in
            :attr:`CheckReport.undecided <gradwatch.engine.results.report.CheckReport.undecided>`, which the next check
            of a series probes again.
        made_by: The portfolio method that makes one probe of it at every check, recomputed and applied
            (:meth:`Portfolio.every_check <gradwatch.engine.probing.portfolio.Portfolio.every_check>`); ``""`` for the
            kinds each check makes in its own turn.
    """

    meaning: str
    moves_parameters: bool = False
    moves_inputs: bool = False
    one_tensor: bool = False
    vouches: bool = False
    starts_culprit_search: bool = False
    _: KW_ONLY
    culprit_search: bool = False
    refocused: bool = False
    made_by: str = ""


PROBE_KINDS: dict[ProbeKind, KindTraits] = {
    ProbeKind.DESCENT: KindTraits(
        "the directional derivative along the normalised gradient ĝ of all parameters",
        moves_parameters=True,
        vouches=True,
        starts_culprit_search=True,
    ),
    ProbeKind.COVER: KindTraits(
        "along a group of parameter tensors' gradients, each weighted to contribute equally to the slope; every tensor "
        "is in a group at every check",
        moves_parameters=True,
        vouches=True,
        starts_culprit_search=True,
    ),
    ProbeKind.TENSOR: KindTraits(
        "along one parameter tensor's own normalised gradient",
        moves_parameters=True,
        one_tensor=True,
        vouches=True,
        starts_culprit_search=True,
        refocused=True,
    ),
    ProbeKind.TENSORS: KindTraits(
        "along every parameter tensor's own normalised gradient at once, each with equal weight (applied checks; a "
        "target other than '*' names the first of a group of tensors probed so together)",
        moves_parameters=True,
        vouches=True,
        starts_culprit_search=True,
    ),
    ProbeKind.RANDOM: KindTraits(
        "along a random unit direction within one parameter tensor (target '*': over all of them, when the gradient "
        "is exactly zero)",
        moves_parameters=True,
        one_tensor=True,
        starts_culprit_search=True,
    ),
    ProbeKind.PARAM: KindTraits(
        "one coordinate of a parameter", moves_parameters=True, one_tensor=True, starts_culprit_search=True
    ),
    ProbeKind.INPUT: KindTraits(
        "along the normalised gradient of the batch's floating inputs (index None), or one coordinate of one of them",
        moves_inputs=True,
        vouches=True,
        starts_culprit_search=True,
    ),
    ProbeKind.LOSS: KindTraits("the loss itself, reported only when it is not finite"),
    ProbeKind.UPDATE: KindTraits(
        "the update the optimizer applied to one tensor (numeric, its norm) against the reference update from the "
        "verified gradient and the kept state (analytic, its norm) (gradwatch.engine.update)",
        vouches=True,
    ),
    ProbeKind.COMPILED: KindTraits(
        "the gradient of one tensor (or of all, target '*') through the training's compiled graph against eager "
        "autograd's (gradwatch.engine.recomputed.compiled)"
    ),
    ProbeKind.ACTIVATION: KindTraits(
        "culprit search: one module's output, displaced along autograd's gradient there", culprit_search=True
    ),
    ProbeKind.MODULE_INPUT: KindTraits(
        "culprit search: one module's inputs as it receives them, displaced along autograd's gradient there",
        culprit_search=True,
    ),
    ProbeKind.MODULE_PARAMS: KindTraits(
        "culprit search: one module's own parameters (its failing ones, where it has any), displaced during its own "
        "forward only",
        culprit_search=True,
    ),
}
"""Every probe kind's properties (see :class:`KindTraits`); the engine branches on these, never on kind names."""


def kinds_where(**traits: bool) -> tuple[ProbeKind, ...]:
    """The kinds whose properties have the given values, in table order: ``kinds_where(culprit_search=True)``."""
    unknown = sorted(set(traits) - set(KindTraits.__dataclass_fields__) - {"meaning", "made_by"})
    if unknown:
        raise ValueError(f"`traits` must name fields of KindTraits; got {unknown}")
    return tuple(kind for kind, row in PROBE_KINDS.items() if all(getattr(row, k) == v for k, v in traits.items()))


class Verdict(StrEnum):
    """What a probe or a check concluded, in order of severity (the logged ``gradwatch/verdict`` scalar is the
    position in this order)."""

    OK = "ok"
    """The analytic gradient agrees with the loss."""
    INCONCLUSIVE = "inconclusive"
    """The probe could not tell (too noisy, or it crossed a kink)."""
    FAIL = "fail"
    """It does not agree, beyond the probe's own numerical error and the relative tolerance."""


class Reason(StrEnum):
    """Why a probe's verdict is what it is (:attr:`gradwatch.engine.results.report.Probe.reason`)."""

    AGREES = "agrees"
    """The derivatives agree within the tolerance, and the probe could have seen a smaller error."""
    DISCREPANCY = "discrepancy"
    """They disagree beyond the tolerance and the probe's own error."""
    MISSING = "missing"
    """The parameter received no gradient, but the loss depends on it."""
    UNRESOLVED = "unresolved"
    """Noise too large to tell."""
    KINK = "kink"
    """The loss is not smooth across the step."""
    FLAT = "flat"
    """The loss did not change at all: the step is below the resolution of its float computation."""
    UNSTABLE = "unstable"
    """The discrepancy did not reproduce at a second step."""
    TIE = "tie"
    """The discrepancy did not survive a shift of the point: the point sits on a tie of the loss."""
    IMPRECISE = "imprecise"
    """Float64 agrees: the native gradient is only the rounding of a correct formula."""
    SURROGATE = "surrogate"
    """A straight-through estimator: the loss is piecewise constant in the tensor."""
    NONFINITE = "nonfinite"
    """The loss or the gradient is not finite."""

    @property
    def retried(self) -> bool:
        """Whether a probe that ended inconclusive for this reason may decide at another point, so a series of checks
        probes its tensor again (kinks, noise, an unstable discrepancy, a tie)."""
        return self in _RETRIED


_RETRIED = frozenset({Reason.KINK, Reason.UNRESOLVED, Reason.UNSTABLE, Reason.TIE})
