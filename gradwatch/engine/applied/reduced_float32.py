"""The noise floor of a float32 path that training runs in TF32: :func:`tf32_floors`.

On Ampere and later GPUs float32 matmuls run in TF32 where ``torch.backends.cuda.matmul.fp32_precision`` (or
``torch.set_float32_matmul_precision("high")``) says so, and cuDNN convolutions and RNNs do by default in torch 2.13:
operands rounded to 10 mantissa bits, about 1e-3 relative error against IEEE float32's 1e-7. The gradient training
applies was computed so, while the check's own recomputations run in IEEE float32
(:func:`~gradwatch.engine.applied.gradients.exact_conditions`): a floor measured there (eager float32 against float64)
would call every healthy TF32 step a failure. So where the settings the check found
(:attr:`~gradwatch.engine.results.report.CheckReport.numerics`) run a path of the model's device in TF32, the floor is
measured on that path as training computes it: the distance of the gradient computed again under training's settings
from the IEEE float32 one (whose own error is 10⁴ times smaller), one backward more, with a note. A wrong backward is
as wrong in TF32 as in IEEE float32, and a 3% error stands far above a 1e-3 floor.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from gradwatch.engine.applied.autocast_path import device_type
from gradwatch.engine.applied.path import PathSetting
from gradwatch.engine.applied.verdict import distances
from gradwatch.engine.results.notes import Note, NoteCode

__all__ = ["tf32_floors"]


def tf32_floors(setting: PathSetting, eager: Sequence[Tensor], notes: list[Note]) -> list[list[float]] | None:
    """The measured distances :func:`~gradwatch.engine.applied.verdict.floors` takes for a float32 path that runs in
    TF32 under training's settings, with a note; ``None`` (no backward) where no path of the device does."""
    paths = setting.session.numerics.reduced_on(device_type(setting.params))
    if not paths:
        return None
    again = setting.eager(ieee=False)
    notes.append(
        Note(
            NoteCode.APPLIED_FLOOR,
            f"training runs float32 {', '.join(paths)} in TF32 (torch.backends): the float32 path's noise floor is "
            "measured as training computes it, the gradient under those settings against IEEE float32's",
        )
    )
    return [distances(list(eager), again)]
