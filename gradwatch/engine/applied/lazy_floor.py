"""The float32 noise floor, measured only when a probe needs it.

On a float32 (or float64) path the floor of a tensor is the larger of the storage rounding ``u · ‖g_T‖`` and the
distance of the eager gradient from a float64 one, which costs a float64 forward and backward of the whole window: on
a CPU float64 convolution, about three training steps. The verdict is monotone in the floor (a larger floor only
widens every tolerance), and the storage rounding is a lower bound of the measured floor, so probes that all agree
against the storage rounding alone agree against the measured floor too: that float64 backward is needed only when a
probe does not agree at first. The check then measures the floor and probes again against it
(:func:`~gradwatch.engine.applied.check.check_applied_gradient`); a healthy check skips it. A 16-bit path measures
its floor up front: its storage rounding is far below what a correct gradient of the path is off by.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from gradwatch.engine.applied.measured import Rounding
from gradwatch.engine.applied.path import PathSetting
from gradwatch.engine.applied.verdict import SPREAD_SCALE, distances, storage_rounding
from gradwatch.engine.numerics.norms import dot
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.errors import own_error


def float64_rounding(
    setting: PathSetting, eager: Sequence[Tensor], applied: Sequence[Tensor], notes: list[Note]
) -> tuple[list[list[float]], Rounding | None]:
    """The distance of the ``eager`` gradient from the float64 one, per tensor (one float64 backward of the window
    ``setting`` runs again), as the list of measured distances :func:`~gradwatch.engine.applied.verdict.floors` takes;
    and, with the ``applied`` gradient, the parts of a probe's discrepancy known without a probe
    (:class:`~.measured.Rounding`). For a model without float64 kernels (Triton, fused CUDA kernels), with a note, the
    float32 backward's own rounding instead: its distance from the gradient of 3x the loss divided by 3, which its
    kernels round otherwise (a fault that scales the gradient cancels out of it), and no known parts."""
    try:
        exact = setting.float64()
    except Exception as error:
        if own_error(error):  # a bug of gradwatch's own is not a model without float64 kernels
            raise
        text = f"no float64 gradient ({type(error).__name__}: {error}): the float32 noise floor is its backward's own"
        notes.append(Note(NoteCode.APPLIED_FLOOR, f"{text} rounding (the spread at {SPREAD_SCALE:g}x the loss)"))
        scaled = setting.eager(scale=SPREAD_SCALE)
        return [distances(list(eager), list(scaled))], None
    rounding = None
    if applied:
        pairs = list(zip(eager, exact, applied, strict=True))
        rounding = Rounding([float(dot(e.double() - x.double(), a)) for e, x, a in pairs],
                            [float(dot(a.double() - e.double(), a)) for e, _, a in pairs])  # fmt: skip
    return [distances(list(eager), exact)], rounding


def floor_note(path_dtype: torch.dtype, floors: Sequence[float], norms: Sequence[float], multiple: float,
               measured: bool) -> Note:  # fmt: skip
    """The note that says which floor the probes were judged against."""
    dtype = str(path_dtype).removeprefix("torch.")
    relative = math.hypot(*floors) / max(math.hypot(*norms), 1e-300)
    rounding = storage_rounding(path_dtype)
    if not measured:
        return Note(
            NoteCode.APPLIED_FLOOR,
            f"noise floor of the {dtype} path not measured: every probe agreed within {multiple:g}x its storage "
            f"rounding ({rounding:.3g} of ‖g‖) plus its own noise, below any floor a measurement could give",
        )
    return Note(
        NoteCode.APPLIED_FLOOR,
        f"noise floor of the {dtype} path: {relative:.3g} of ‖g‖ (storage rounding alone {rounding:.3g}); a probe "
        f"fails beyond {multiple:g}x the floor plus its own noise",
    )
