"""A 16-bit autocast path: its noise floor, and its precision where no one named it.

An applied check judges the gradient against the noise floor of the precision the training's path computes in. Where
the loop does not name that path (``path=``), the check must not take a correct 16-bit gradient for a wrong float32
one. Two cases are common:

* **the model enters autocast itself** (in its ``forward``, or a loss that enters ``accelerator.autocast()``): the
  check's reference pass holds that region off and sees it entered (:func:`own_autocast`); the path is then judged as
  that autocast path, its recomputation letting the model's own region run;
* **the loop runs its forward under** ``torch.autocast`` **and did not say so**: where the applied gradient is further
  from eager float32's than :data:`SCREEN` (a float32 path differs by ~1e-7 of ``‖g‖``, a 16-bit one by 5e-4 and
  more), the window is run again under each autocast dtype of the parameters' device before any probe
  (:func:`reproducing_autocast`); one whose gradient reproduces the applied one :data:`ADOPTION_RATIO` times more
  closely than eager float32 (bit for bit on CPU) is the path the forward ran on, judged with that path's floor, with a
  note. A gradient changed after the backward is reproduced by no dtype: a float32 loop's faults stay float32 faults.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradwatch.engine.applied.gradients import Gradient
from gradwatch.engine.applied.path import AppliedPlan, CheckedWindow
from gradwatch.engine.applied.verdict import SPREAD_SCALE, distances, floor_multiple, floors
from gradwatch.engine.applied.window import PathContext, autocast_context
from gradwatch.engine.numerics.norms import norms
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.errors import passes_fallbacks

SIXTEEN_BITS = (torch.bfloat16, torch.float16)

ADOPTION_RATIO = 0.25
"""How much closer to the applied gradient than eager float32's an autocast recomputation must come for its dtype to
be adopted: 16-bit rounding does not bring a float32 gradient changed after the backward closer, while the path's own
recomputation reproduces the applied gradient exactly (CPU) or within the kernels' nondeterminism."""


SCREEN = 1e-4
"""How far from eager float32's gradient, relative to its norm, the applied one must be for the check to try autocast
paths (measured on CPU, windows of 1 and 4 micro-batches of an MLP, a CNN and a transformer: float32 paths 0 to 6e-8,
bf16 autocast 4e-3 to 4e-2, fp16 autocast 6e-4 to 1.4e-2): a float32 loop does not pay for the replays."""


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def device_type(params: Sequence[Tensor]) -> str:
    """The device type the parameters live on (``"cpu"`` without any)."""
    return params[0].device.type if params else "cpu"


def path_autocast(path: PathContext | None) -> torch.dtype | None:
    """The autocast dtype the path's context enables (on any device), or ``None``."""
    if path is None:
        return None
    with path():
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                return torch.get_autocast_dtype(device)
    return None


def own_autocast(entered: Sequence[tuple[str, torch.dtype]], device: str) -> torch.dtype | None:
    """The 16-bit dtype of the first autocast region the loss's code tried to enter on ``device`` (``entered``, as
    :func:`~gradwatch.engine.function.conditions.autocast_held_off` records them), else ``None``."""
    return next((dtype for kind, dtype in entered if kind == device and dtype in SIXTEEN_BITS), None)


def own_note(dtype: torch.dtype, device: str) -> Note:
    """The note of a path whose precision the model's own autocast region gave."""
    return Note(
        NoteCode.APPLIED_PATH_INFERRED,
        f"the loss enters {device} autocast to {_name(dtype)} itself (in the model's forward or the loss): the path "
        f"is judged as a {_name(dtype)} autocast path, its noise floor measured on it",
    )


def replanned(plan: AppliedPlan, dtype: torch.dtype) -> AppliedPlan:
    """``plan`` judged on an autocast path to ``dtype``."""
    return dataclasses.replace(plan, path_dtype=dtype, multiple=floor_multiple(dtype))


def autocast_floors(setting: CheckedWindow, eager: Gradient, again: Gradient) -> list[list[float]]:
    """The measured distances of a 16-bit autocast path's floor (:func:`~.verdict.floors`): the emulated gradient
    against ``eager``, and the path's gradient ``again`` against its gradient of :data:`~.verdict.SPREAD_SCALE` times
    the loss (two backward passes)."""
    assert setting.autocast is not None
    emulated = distances(setting.eager(emulated=setting.autocast), eager)  # its gradient freed before the next
    return [emulated, distances(again, setting.gradient(scale=SPREAD_SCALE)[1])]


SHIFT = 1e-3
"""The relative size of the random shifts of the parameters at which :func:`disagreement_recurs` looks again."""

SHIFTED_POINTS = 2
"""How many shifted points a 16-bit path's disagreement must recur at to be its kernels' fault."""


def disagreement_recurs(setting: CheckedWindow, plan: AppliedPlan, tensors: Sequence[int]) -> tuple[bool, int]:
    """Whether a 16-bit autocast path's gradient stays further from eager float32's, in each of ``tensors``, than the
    floor's multiple allows at each of :data:`SHIFTED_POINTS` points, the parameters scaled by ``1 + SHIFT · N(0, 1)``
    element by element (the same draws on every rank), the floor measured again at each; with the backward passes
    spent (four per point). A correct path's rounding can cross a kink the emulated rounding does not (a ReLU input
    within its rounding of 0: a tiny bf16 transformer's ``linear1`` at 30 times its floor at one point, 1.2-1.4 times at
    five shifted ones); a wrong 16-bit kernel is wrong at every point. The parameters are put back bit for bit; on
    shards nothing is tried and the disagreement stands."""
    if setting.autocast is None or setting.session.collective is not None or not tensors:
        return True, 0
    params = setting.params
    kept = [p.detach().clone() for p in params]
    generator = torch.Generator().manual_seed(len(tensors))
    try:
        for point in range(SHIFTED_POINTS):
            with torch.no_grad():
                for param, value in zip(params, kept, strict=True):
                    draw = torch.randn(value.shape, generator=generator, dtype=torch.float64)
                    param.copy_((value.double() * (1 + SHIFT * draw)).to(value.dtype))
            eager = setting.eager()
            again = setting.gradient()[1]
            measured = autocast_floors(setting, eager, again)
            floor = floors(measured, norms(again, exact=True), plan.path_dtype)
            apart = distances(again, eager)
            if all(apart[i] <= plan.multiple * floor[i] for i in tensors):
                return False, 4 * (point + 1)
        return True, 4 * SHIFTED_POINTS
    finally:
        with torch.no_grad():
            for param, value in zip(params, kept, strict=True):
                param.copy_(value)


def candidates(device: str) -> list[tuple[torch.dtype, PathContext]]:
    """The autocast contexts a forward on ``device`` may have run under, the most common first."""
    if not torch.amp.autocast_mode.is_autocast_available(device):
        return []
    order = (torch.float16, torch.bfloat16) if device == "cuda" else (torch.bfloat16, torch.float16)
    if device == "cuda" and not torch.cuda.is_bf16_supported():
        order = (torch.float16,)  # type: ignore[assignment]
    return [(dtype, autocast_context(device, dtype)) for dtype in order]


@dataclass(frozen=True)
class Inferred:
    """What :func:`reproducing_autocast` found (``setting`` ``None``: no autocast path reproduces the gradient)."""

    setting: CheckedWindow | None
    gradient: Gradient | None
    backward: int
    note: Note | None


def reproducing_autocast(setting: CheckedWindow, applied: Sequence[Tensor], eager: Gradient) -> Inferred:
    """The autocast path among :func:`candidates` whose window gradient reproduces ``applied`` :data:`ADOPTION_RATIO`
    times closer than ``eager`` (the path's gradient without autocast) does, if one does (see the module doc): none
    tried within :data:`SCREEN`, else one backward pass per candidate, stopping at one that reproduces it exactly."""
    device = device_type(setting.params)
    missing = math.hypot(*distances(eager, list(applied)))
    size = math.hypot(*norms(list(applied), exact=True))
    best: tuple[float, CheckedWindow, Gradient] | None = None
    backward = 0
    if missing > SCREEN * size and math.isfinite(missing):
        for dtype, context in candidates(device):
            trial = dataclasses.replace(setting, path=context, autocast=dtype)
            try:
                gradient = trial.gradient()[1]
            except Exception as error:  # a dtype this device's autocast cannot run (no kernel for an operator)
                if passes_fallbacks(error):
                    raise
                continue
            backward += 1
            distance = math.hypot(*distances(gradient, list(applied)))
            if best is None or distance < best[0]:
                best = (distance, trial, gradient)
            if distance == 0:
                break
    if best is None or not best[0] <= ADOPTION_RATIO * missing:
        return Inferred(None, None, backward, None)
    distance, trial, gradient = best
    assert trial.autocast is not None
    name = _name(trial.autocast)
    closeness = (
        "reproduces the applied one bit for bit"
        if distance == 0
        else f"is {distance / missing:.2g} times as far from the applied one as eager float32's"
    )
    text = (
        f"the window's forward ran under {device} autocast to {name}: recomputed so, its gradient {closeness}; the "
        f'path is judged as that autocast path (pass path=lambda: torch.autocast("{device}", dtype=torch.{name}) '
        "to skip this inference)"
    )
    return Inferred(trial, gradient, backward, Note(NoteCode.APPLIED_PATH_INFERRED, text))
