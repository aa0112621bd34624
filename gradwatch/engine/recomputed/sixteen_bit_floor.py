"""The tolerance of a pure-16-bit model, measured on its own path instead of assumed.

A model whose parameters are bfloat16 or float16 (``model.to(torch.bfloat16)``, no autocast, as many LLM fine-tunes
train) computes a gradient whose rounding is far above float32's, but far below the fixed relative tolerance that
covers every 16-bit model (0.1 for bfloat16: a 5% and even a 20% bug in a 16-bit kernel read ``ok`` against it). Float64
probes measure the exact derivative to ~1e-6, so the tolerance is set by the gradient's own rounding, which is measured
as the applied check measures its floor (:mod:`gradwatch.engine.applied.verdict`), per tensor ``T``, as the largest of:

* the **forward's and formulas' rounding**: ``‖g_16,T − g_64,T‖`` between the gradient computed on float64 storage with
  every result rounded to the 16-bit dtype (:class:`~gradwatch.engine.function.sixteen_bit.SixteenBitRounding`: float64
  formulas, 16-bit rounding, so a backward wrong only for 16-bit inputs is not in it) and the plain float64 gradient;
* the **backward kernels' own rounding**: the spread ``‖g_1,T − g_3,T / 3‖`` between the model's own gradient of the
  loss and of three times the loss, which the same kernels round differently (a fault that scales a gradient is the
  same in both and cancels out of the spread);
* the **storage rounding** ``u · ‖g_T‖``.

By Cauchy-Schwarz, a correct gradient is off along any unit direction within ``T`` by at most that distance. Each probe
is judged against the floors of the tensors it moves (:class:`~gradwatch.engine.probing.tolerances.TensorTolerances`):
:data:`FLOOR_MULTIPLE` times the floor of its tensor, or of its tensors together along its direction, at most
:data:`MOST` (one tolerance for all, capped at the dtype's fixed one, let a 5% bug read ``ok`` on a small bf16 CNN and
was below what a kink moved by rounding does to a correct float16 gradient). The forward's rounding is measured at
:data:`REALIZATIONS` more points half a unit in the last place away (one draw of it can be orders of magnitude below
another where a kink moves), and once more with the native forward's own values at every leaf module's 16-bit output
(:mod:`~gradwatch.engine.function.native_values`: a 16-bit kernel that rounds inside moves kinks that the emulation,
rounding each result once, does not). The check's ``rtol``, for the probes of inputs and activations, is the largest
tolerance within the fixed one. It costs one native backward (of 3x the loss) and seven float64 forwards and backwards
on the probe batch, only for 16-bit models probed in float64.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from gradwatch.engine.function.complex_params import autograd_tensor
from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.function.native_values import NativeValues
from gradwatch.engine.function.sixteen_bit import SIXTEEN_BIT, SixteenBitRounding
from gradwatch.engine.numerics.norms import norms
from gradwatch.engine.numerics.steps import gradient_tolerance, machine_epsilon, relative_tolerance
from gradwatch.engine.probing.plan import ProbePlan
from gradwatch.engine.probing.tolerances import TensorTolerances
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.errors import passes_fallbacks

FLOOR_MULTIPLE = 3.0
"""How many times its measured floor a 16-bit gradient may be off (``torch._dynamo.utils.same``'s multiple in 16 bits,
as the applied check allows a 16-bit path)."""

MOST = 1.0
"""The largest tolerance of a parameter probe: a gradient off by more than its whole slope (a sign flip) beyond the
floors still fails. The dtype's fixed tolerance does not cap a measured one: a correct float16 gradient of a CNN's
BatchNorm weight was measured 6% off where 16-bit rounding moved a kink, beyond the fixed 3e-2, and a cap there turned
that rounding into a failure."""

REALIZATIONS = 2
"""How many more points the forward's and formulas' rounding is measured at (see
:meth:`SixteenBitFloor._other_realizations`)."""

SPREAD_SCALE = 3.0
"""The loss factor of the spread measurement: not a power of two, so that every rounding of the backward changes."""


def wanted(plan: ProbePlan, params: Sequence[tuple[str, Tensor]]) -> bool:
    """Whether a check measures its floor: a 16-bit model probed in float64, no tolerance given, real parameters."""
    return (
        plan.measure_floor
        and plan.native_dtype in SIXTEEN_BIT
        and plan.precision == "float64"
        and all(not p.is_complex() for _, p in params)
    )


def _gradients(evaluator: LossEvaluator, scale: float = 1.0) -> list[Tensor] | None:
    """The gradient of ``scale`` times the loss at the evaluator's parameters (whichever storage they are on), divided
    by ``scale``, in float64; ``None`` if it is not finite."""
    tensors = [autograd_tensor(p) for _, p in evaluator.params]
    changed = [t for t in tensors if not t.requires_grad]
    loss_fn = evaluator.loss_fn
    if scale != 1.0:
        evaluator.loss_fn = lambda model, batch: scale * loss_fn(model, batch)
    try:
        for t in changed:
            t.requires_grad_(True)
        _, grads = evaluator.gradients_wrt(lambda: tensors)
    finally:
        evaluator.loss_fn = loss_fn
        for t in changed:
            t.requires_grad_(False)
    found = [torch.zeros(t.shape, dtype=torch.float64) if g is None else g.detach().double() / scale
             for t, g in zip(tensors, grads, strict=True)]  # fmt: skip
    return found if all(bool(torch.isfinite(g).all()) for g in found) else None


def _distances(a: Sequence[Tensor], b: Sequence[Tensor]) -> list[float]:
    return norms([x - y.to(x.device) for x, y in zip(a, b, strict=True)], exact=True)


@dataclasses.dataclass
class SixteenBitFloor:
    """The measured floor of one check: the native spread first (on the native storage), then the rounding of the
    forward and formulas (on float64 storage), then the tolerance they give."""

    evaluator: LossEvaluator
    plan: ProbePlan
    grad_norms: Sequence[float]
    loss: float
    spread: list[float] | None = None
    native: NativeValues | None = None
    """The leaf modules' outputs of the native forward of the spread's measurement."""
    _: dataclasses.KW_ONLY
    error: str = ""
    """What the last measurement that raised said."""
    notes: list[Note] = dataclasses.field(default_factory=list)

    def measure_spread(self, reference: Sequence[Tensor | None]) -> None:
        """The backward's own rounding against the ``reference`` gradient (the check's own, on the same samples), on
        the native parameters (before the check moves to float64 storage)."""
        params = [p for _, p in self.evaluator.params]
        native = [torch.zeros(p.shape, dtype=torch.float64) if g is None else g.detach().double()
                  for p, g in zip(params, reference, strict=True)]  # fmt: skip
        self.native = NativeValues(self.evaluator.model)
        with self.native.recording():
            scaled = self._guarded(lambda: _gradients(self.evaluator, SPREAD_SCALE))
        self.spread = None if scaled is None else _distances(native, scaled)

    def plan_on_float64(self) -> ProbePlan:
        """The plan with its tolerance measured (the evaluator on float64 storage); unchanged, with a note, where a
        measurement could not be made."""
        dtype = self.plan.native_dtype
        if self.spread is None:
            return self._fixed("the model's gradient of 3x the loss is not finite or could not be computed")
        # the other points first: every evaluation after them is at the check's point again
        others = self._other_realizations(dtype)
        precise = self._guarded(lambda: _gradients(self.evaluator))
        if precise is None:
            return self._fixed("no finite float64 gradient")
        with SixteenBitRounding(dtype):
            rounded = self._guarded(lambda: _gradients(self.evaluator))
        if rounded is None:
            return self._fixed(f"no finite gradient with {_name(dtype)} rounding emulated")
        forward = _distances(rounded, precise)
        if self.native is not None and self.native.outputs:
            with self.native.replayed():
                replayed = self._guarded(lambda: _gradients(self.evaluator))
            self.native.outputs = {}
            if self.native.unreplayed:
                unreplayed = _unreplayed_note(sorted(self.native.unreplayed), dtype)
                self.notes.append(unreplayed)
            if replayed is not None:
                others.append(_distances(replayed, precise))
        for other in others:
            forward = [max(a, b) for a, b in zip(forward, other, strict=True)]
        rounding = machine_epsilon(dtype) / 2
        floors = [max(f, s, rounding * n) for f, s, n in zip(forward, self.spread, self.grad_norms, strict=True)]
        fixed = relative_tolerance(dtype)
        tolerances = TensorTolerances(tuple(floors), tuple(self.grad_norms), FLOOR_MULTIPLE,
                                      lowest=relative_tolerance(torch.float32), highest=MOST, loss=self.loss,
                                      dtype=dtype, negligible=machine_epsilon(dtype) ** (1 / 3))  # fmt: skip
        per_tensor = tolerances.per_tensor
        # the probes of inputs and activations, whose floor is not measured: the largest, within the fixed tolerance
        least = gradient_tolerance(relative_tolerance(torch.float32), self.loss, dtype)
        rtol = max(min(fixed, max(per_tensor, default=least)), least)
        low, high = min(per_tensor, default=rtol), max(per_tensor, default=rtol)
        middle = statistics.median(per_tensor) if per_tensor else rtol
        self.notes.append(Note(NoteCode.SIXTEEN_BIT_FLOOR, (
            f"{_name(dtype)} parameters: tolerances per tensor from the noise floor measured on the model, "
            f"{FLOOR_MULTIPLE:g}x each tensor's: {low:.3g} to {high:.3g} (median {middle:.3g}; the fixed "
            f"{_name(dtype)} tolerance {fixed:g} holds for inputs); a probe over several tensors is judged against "
            "their floors together")))  # fmt: skip
        return dataclasses.replace(self.plan, rtol=rtol, measured_floor=True, tolerances=tolerances)

    def _other_realizations(self, dtype: torch.dtype) -> list[list[float]]:
        """The forward's and formulas' rounding measured again at :data:`REALIZATIONS` points moved from the check's by
        at most half a unit in the last place of ``dtype`` (every element, at random): other draws of the same rounding,
        which differ from the first by orders of magnitude where rounding moves a kink (a ReLU or max-pool that 16 bits
        break the other way: 0.09% to 6% of a BatchNorm weight's gradient, float16, one point). Two float64 forwards and
        backwards each; the points are put back exactly."""
        tensors = [autograd_tensor(p) for _, p in self.evaluator.params]
        saved = [t.detach().clone() for t in tensors]
        generator = torch.Generator().manual_seed(0)
        found: list[list[float]] = []
        try:
            for _ in range(REALIZATIONS):
                with torch.no_grad():
                    for tensor, origin in zip(tensors, saved, strict=True):
                        noise = torch.rand(origin.shape, generator=generator, dtype=torch.float64) - 0.5
                        tensor.copy_(origin * (1 + machine_epsilon(dtype) * noise.to(origin.device)))
                precise = self._guarded(lambda: _gradients(self.evaluator))
                with SixteenBitRounding(dtype):
                    rounded = self._guarded(lambda: _gradients(self.evaluator))
                if precise is not None and rounded is not None:
                    found.append(_distances(rounded, precise))
        finally:
            with torch.no_grad():
                for tensor, origin in zip(tensors, saved, strict=True):
                    tensor.copy_(origin)
        return found

    def _fixed(self, why: str) -> ProbePlan:
        dtype = self.plan.native_dtype
        self.notes.append(Note(NoteCode.SIXTEEN_BIT_FLOOR, (
            f"{_name(dtype)} parameters: the fixed tolerance {self.plan.rtol:.3g}, no floor measured ({why}"
            f"{self.error})")))  # fmt: skip
        return self.plan

    def _guarded(self, measure: Callable[[], list[Tensor] | None]) -> list[Tensor] | None:
        try:
            return measure()
        except Exception as error:  # a loss that refuses the rounding emulation: the fixed tolerance, with a note
            if passes_fallbacks(error):
                raise
            self.error = f" ({type(error).__name__}: {error})"
            return None


def _unreplayed_note(names: list[str], dtype: torch.dtype) -> Note:
    shown = ", ".join(f"`{name}`" for name in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return Note(
        NoteCode.SIXTEEN_BIT_FLOOR,
        f"{shown}: the {_name(dtype)} output differs from the float64 one by more than {_name(dtype)} rounding of "
        "its result (an ill-conditioned operation, a forward wrong in 16 bits, or what such an output reaches); the "
        f"floor does not take these modules' {_name(dtype)} values",
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
