"""What the probes of an applied check are asked to do, as one object: :class:`AppliedPlan`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from gradwatch.engine.numerics.norms import norms


@dataclass(frozen=True, kw_only=True)
class AppliedPlan:
    """What the probes of an applied check are asked to do: the gradient they measure and how they judge it.

    Attributes:
        names: The checked parameters' names.
        applied: The applied gradient, one tensor per checked parameter (this rank's rows of it when sharded).
        native: The parameters' dtype (the most precise of them).
        path_dtype: The precision of the training's path (its autocast dtype, else ``native``).
        multiple: How many noise floors of the path a gradient may be off.
        tensor_probes: Tensors probed along their own applied gradient per check, in turn, when the combined probes
            call for them (see :mod:`.combined`; every tensor once a probe fails).
        rotation: Which turn of tensors this check probes.
        eager: On a 16-bit path, eager float32 autograd's gradient of the window (``None`` otherwise): a tensor whose
            applied gradient is further from it than its floor allows is probed on its own
            (:func:`~.measured.off_eager`).
        closer_look: ``False``: the check stops after its combined probes when they all agree, leaving the float64
            floor, groups and tensor probes to a later check (a watch's first applied check: :mod:`.closer_look`).
        float64: ``False``: the probes run natively (float64 reductions) without trying float64 first (a watch whose
            earlier applied check's float64 probes ran out of memory: :class:`~gradwatch.watch.lessons.Lessons`).
    """

    names: list[str]
    applied: list[Tensor]
    native: torch.dtype
    path_dtype: torch.dtype
    multiple: float
    tensor_probes: int
    rotation: int
    eager: list[Tensor] | None = None
    closer_look: bool = True
    float64: bool = True

    @cached_property
    def applied_norms(self) -> list[float]:
        """``‖g_T‖`` of each tensor of ``applied``, accumulated in float64: computed once for the plan (the floors,
        the probes' directions and their tensor choices all ask for them)."""
        return norms(self.applied, exact=True)
