"""The facts of one accumulation window, as the applied check runs its path again (:class:`CheckedWindow`), and what its
probes are asked to do (:class:`AppliedPlan`).

Every step of an applied check (its floor, the probes' window loss, the one-batch comparison, the attribution) needs
the same facts about the window; they travel as one object, which also runs the window's gradient again along the
paths those steps compare (:mod:`.gradients`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch.engine.applied import gradients
from gradwatch.engine.applied.gradients import Gradient, R
from gradwatch.engine.applied.window import Checksums, Combine, PathContext, window_loss
from gradwatch.engine.function.evaluation import LossFn
from gradwatch.engine.function.state import TrainingState
from gradwatch.engine.numerics.norms import norms
from gradwatch.engine.probing.search_budget import SearchBudget
from gradwatch.engine.session import CheckSession


@dataclass(kw_only=True)
class CheckedWindow:
    """The training's path, as the check can run it again: the check's ``session``, the window's micro-batches with
    their random states and how the loop combines their losses, the context the forward ran in (``autocast``: its
    dtype; ``compiled``: whether the model holds compiled code), the DDP ``group``, the fingerprint of the gradients
    present when the window began, the loop's loss scale, and the cap on a formula fault's culprit search."""

    session: CheckSession
    batches: list[Any]
    loss_fn: LossFn
    rng_states: Sequence[dict[str, Any] | None]
    combine: Combine
    path: PathContext | None
    autocast: torch.dtype | None = None
    compiled: bool = False
    group: Any = None
    start: Checksums | None = None
    loss_scale: float = 1.0
    search_budget: SearchBudget | None = None

    @property
    def model(self) -> nn.Module:
        return self.session.model

    @property
    def params(self) -> list[Tensor]:
        """The tensors the check moves: the checked parameters (their local shards when sharded)."""
        return [p for _, p in self.session.params]

    @property
    def state(self) -> TrainingState:
        assert self.session.state is not None, "the path is run again inside session.measuring()"
        return self.session.state

    def window(self, with_path: bool = True) -> LossFn:
        return window_loss(self.loss_fn, self.rng_states, self.combine, self.path if with_path else None)

    def gradient(self, *, with_path: bool = True, compiled: bool = True, scale: float = 1.0) -> tuple[float, Gradient]:
        """The window's loss and gradient on the training's path (:func:`~.gradients.path_gradient`), without the
        path's context (nor any autocast the forward enters itself) unless ``with_path``, compiled code run eagerly
        unless ``compiled``, the loss scaled by ``scale`` on top of the loop's own scale."""
        return gradients.path_gradient(self.model, self.batches, self.window(with_path), self.params, self.state,
                                       compiled=compiled, autocast=with_path, group=self.group,
                                       scale=scale * self.loss_scale)  # fmt: skip

    def eager(self, *, scale: float = 1.0, ieee: bool = True, emulated: torch.dtype | None = None) -> Gradient:
        """:func:`~.gradients.eager_gradient` of the window's loss."""
        return gradients.eager_gradient(self.model, self.batches, self.window(with_path=False), self.params,
                                        self.state, group=self.group, scale=scale, ieee=ieee,
                                        emulated=emulated)  # fmt: skip

    def float64(self) -> Gradient:
        """:func:`~.gradients.float64_gradient` of the window's loss."""
        return gradients.float64_gradient(self.model, self.batches, self.window(with_path=False), self.params,
                                          self.state, group=self.group)  # fmt: skip

    def float64_reduced(self, reduce: Callable[[int, Tensor], R]) -> list[R]:
        """:func:`~.gradients.float64_reduced` of the window's loss: ``reduce(i, g_i)`` of each tensor's float64
        gradient, without the whole float64 gradient held where it can."""
        return gradients.float64_reduced(self.model, self.batches, self.window(with_path=False), self.params,
                                         self.state, reduce, group=self.group)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class AppliedPlan:
    """What the probes of an applied check are asked to do: the gradient they measure and how they judge it.

    Attributes:
        names: The checked parameters' names.
        applied: The applied gradient, one tensor per checked parameter (this rank's rows of it when sharded).
        native: The parameters' dtype (the most precise of them).
        path_dtype: The precision of the training's path (its autocast dtype, else ``native``).
        multiple: How many noise floors of the path a gradient may be off.
        tensor_probes: Tensors probed along their own applied gradient per check, in turn (:mod:`.measured`).
        rotation: Which turn of tensors this check probes.
        eager: On a 16-bit path, eager float32 autograd's gradient of the window (``None`` otherwise): a tensor whose
            applied gradient is further from it than its floor allows is probed (:func:`~.measured.off_eager`).
        closer_look: ``False``: the check stops after its combined probes when they all agree (:mod:`.probes`).
        float64: ``False``: the probes run natively (float64 reductions) without trying float64 first.
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
        """``‖g_T‖`` of each tensor of ``applied``, accumulated in float64, computed once."""
        return norms(self.applied, exact=True)
