"""The probe options of a check, as one object validated once: :class:`ProbeSettings`.

Every entry point builds it from its keyword arguments (typed by :class:`ProbeOptions`) or takes it whole
(``settings=``), so that the options are validated, documented and defaulted in this one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from gradwatch.engine import validation as validate
from gradwatch.engine.function.precision import PRECISIONS, Precision


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
    """What a check probes and how: the options of :func:`gradwatch.check_gradients` that stay the same from one check
    of a run to the next (``step``, ``rotation`` and ``focus`` change at every check and are passed beside it).

    An applied check (:func:`gradwatch.check_applied_gradient`) uses ``tensor_probes``, ``ignore``, ``seed`` (the seed
    of its culprit search) and ``hold_detached``; the other fields concern the recomputed check alone.

    Every field is validated at construction (``ValueError`` naming the field, what was expected and what was
    received); :func:`dataclasses.replace` validates again.

    Args:
        tensor_probes: Tensors probed along their own gradient per check (in turn; every tensor after a failure); an
            applied check probes as many along their own part of the applied gradient.
        random_probes: Tensors probed along a random direction per check (in turn), besides every tensor that
            received no gradient at all.
        param_probes: Coordinate probes on parameters (stratified by tensor; 0 to skip).
        input_probes: Probes on the floating inputs of the batch: the first along their gradient, the others at
            single coordinates (0 to skip input probes and the input gradient altogether).
        probe_batch_size: Check the loss of the first this many samples of the batch (every tensor whose first
            dimension is the batch size is cut), which makes every evaluation cheaper; ``None`` for the whole batch.
            The loss checked is exactly the loss of that slice, so verdicts stay exact. A series of checks
            (:class:`~gradwatch.GradientWatch`) probes 2 samples by default: one would hide bugs that mix the samples
            of a batch; a loss that refuses the slice is probed on four, else on the whole batch.
        precision: ``"native"`` evaluates probes in the parameters' dtype, ``"float64"`` on float64 storage of the
            parameters, buffers and inputs (the analytic gradient is still the native one), ``"auto"`` picks float64
            unless the model has more than 2**25 parameter elements, float64 would not fit in the device's free memory
            or costs more than 10 native reference passes on the device. See :mod:`gradwatch.engine.function.precision`.
        ignore: Shell-style patterns (``fnmatch``) of parameter names not to check, e.g. ``["quantizer.*"]`` for a
            straight-through estimator whose gradient is deliberately not the derivative.
        rtol: Relative tolerance; ``None`` picks it from the parameters' dtype (5e-4 for float32, 1e-7 for float64;
            for 16-bit parameters probed in float64, measured on the model at each check, at most 3e-2 for float16 and
            1e-1 for bfloat16: :mod:`gradwatch.engine.recomputed.sixteen_bit_floor`). Either is raised to about
            ``4 ε / |loss|`` for a loss near zero, where autograd's own rounding is that large (``report.rtol`` says
            what was used); below a float32 loss of ~1e-5 no probe is made. With ``None``, a float32 gradient within
            the tolerance still fails where float64 autograd shows its formula wrong by more than 1e-6 (float64 probes:
            :mod:`gradwatch.engine.recomputed.formula`); a given ``rtol`` is what the check accepts, and no more.
        seed: Seed of the sampling; the same ``seed`` and ``step`` probe the same coordinates and directions (so every
            process of a distributed run probes the same ones).
        float64_reductions: Accumulate the loss's final sums and means in float64 during finite differences
            (see :mod:`gradwatch.engine.function.reductions`). Turn off only to study the effect.
        vectorize: Evaluate the points of float64 probes together, in few forward passes with ``torch.func.vmap`` (see
            :mod:`gradwatch.engine.measuring.vectorized`); losses vmap cannot run are evaluated point by point either
            way (and a series of checks stops trying after the first). Turn off for a loss with side effects that must
            happen once per point (a forward hook that records activations).
        fail_on_imprecise: A float32 (or 16-bit) gradient whose formula is right but whose rounding exceeds ``rtol``
            (float64 autograd agrees with the float64 finite difference) is a probe ``"ok"`` with reason
            ``"imprecise"``; with ``True`` it fails. See :mod:`gradwatch.engine.recomputed.confirmation`.
        hold_detached: Check the function autograd differentiates where the loss's own code detaches: the values
            ``detach()`` returns in ``loss_fn`` outside the forward of the model's modules are held, in every
            evaluation after the reference, at what they were there. For a surrogate objective whose value is not the
            function its gradient differentiates (GRPO's ``exp(logp - logp.detach())``, 1 at every point); see
            :mod:`gradwatch.engine.function.held`. Detaches inside the model's modules are never held: an accidental
            one still fails.

    Raises:
        ValueError: A field is out of range or of the wrong type.

    Example:
        >>> from gradwatch.engine.settings import ProbeSettings
        >>> ProbeSettings(param_probes=4, precision="native").param_probes
        4
    """

    tensor_probes: int = 6
    random_probes: int = 1
    param_probes: int = 1
    input_probes: int = 1
    probe_batch_size: int | None = None
    precision: Precision = "auto"
    _: dataclasses.KW_ONLY
    ignore: tuple[str, ...] = ()
    rtol: float | None = None
    seed: int = 0
    float64_reductions: bool = True
    vectorize: bool = True
    fail_on_imprecise: bool = False
    hold_detached: bool = False

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # the checks every field's annotation asks for
            if field.type == "int":
                validate.check_int(field.name, getattr(self, field.name), minimum=0)
            elif field.type == "bool":
                validate.check_bool(field.name, getattr(self, field.name))
        validate.check_optional_int("probe_batch_size", self.probe_batch_size, minimum=1)
        validate.check_choice("precision", self.precision, PRECISIONS)
        # a list is accepted and kept as a tuple, so that the settings stay hashable and immutable
        object.__setattr__(self, "ignore", validate.check_patterns("ignore", self.ignore))
        object.__setattr__(self, "rtol", validate.check_fraction("rtol", self.rtol, optional=True))

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The names of the fields, in order (the keyword arguments of :func:`gradwatch.check_gradients` they are)."""
        return tuple(field.name for field in dataclasses.fields(cls))


class ProbeOptions(TypedDict, total=False):
    """The probe options as keyword arguments (``**options: Unpack[ProbeOptions]``) of every entry point that takes
    them one by one besides ``settings=``: the fields of :class:`ProbeSettings`, which hold their defaults and their
    documentation (the API reference shows them in each entry point's signature: ``docs/griffe_options.py``)."""

    tensor_probes: int
    random_probes: int
    param_probes: int
    input_probes: int
    probe_batch_size: int | None
    precision: Precision
    ignore: Sequence[str]
    rtol: float | None
    seed: int
    float64_reductions: bool
    vectorize: bool
    fail_on_imprecise: bool
    hold_detached: bool


def settings_of(
    settings: ProbeSettings | None, options: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> ProbeSettings:
    """The settings of an entry point that takes ``settings=`` or the probe options one by one (``options``, only those
    given), not both; ``defaults`` are the entry point's own defaults for options left out (a series of checks probes 2
    samples). An unknown option is the entry point's to refuse, with the nearest valid name
    (:func:`~gradwatch.engine.validation.suggests_options`)."""
    if settings is not None:
        if not isinstance(settings, ProbeSettings):
            raise TypeError(f"`settings` must be None or a ProbeSettings; got {type(settings).__name__}")
        if options:
            raise ValueError(
                f"pass the probe options either one by one or as `settings`, not both; got `settings` and "
                f"{sorted(options)}"
            )
        return settings
    return ProbeSettings(**{**(defaults or {}), **options})
