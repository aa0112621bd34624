"""The parameters as they were when a loss's forward ran, for the applied check of a step that applies its gradient
after other optimizers' steps have moved some of them (one loss and one backward for Muon and AdamW; Lightning's
manual optimization, whose ``training_step`` may step an optimizer between two losses).

The earlier steps' parameters are copied before each update (:func:`before_update`, an entry of :data:`Earlier`) and
:class:`Rewind` puts those values in the module's parameter slots while the check's loss runs, as a check puts its
float64 copies there, and takes them out afterwards: the parameters themselves are never written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch.engine import LossFn

__all__ = ["Earlier", "Rewind", "before_update", "rewound"]


Earlier = Sequence[tuple[torch.optim.Optimizer, dict[str, Tensor]]]
"""The optimizer steps taken since the checked loss's forward began (a batch's steps before the checked one), in order:
the optimizer, and the values its parameters held before its update, by name."""


class Rewind:
    """The parameters of the ``earlier`` steps as they were when the loss's forward began: each at the value it held
    before the first of those steps that updated it; :meth:`stepped` moves them on as a loss run again reaches each
    step (Lightning's ``training_step``), to the value before their next step or the module's own. Values are put in
    the module's parameter slots (every slot that holds the parameter: tied weights), never written into a parameter."""

    def __init__(self, module: nn.Module, earlier: Earlier) -> None:
        self.module, self.earlier = module, earlier
        self.timeline: dict[str, list[tuple[int, Tensor]]] = {}
        for step, (_, values) in enumerate(earlier, start=1):
            for name, value in values.items():
                self.timeline.setdefault(name, []).append((step, value))
        self.occupants: dict[str, Tensor] = {}
        self.slots: dict[str, list[tuple[dict[str, Any], str]]] = {}

    def __enter__(self) -> Rewind:
        for name in self.timeline:  # what the slots hold now (the check's float64 copy, a perturbed value, ...)
            prefix, _, leaf = name.rpartition(".")
            self.occupants[name] = self.module.get_submodule(prefix)._parameters[leaf]  # type: ignore[assignment]
        held = {id(tensor): name for name, tensor in self.occupants.items()}
        for module in self.module.modules():
            for key, tensor in module._parameters.items():
                if tensor is not None and id(tensor) in held:
                    self.slots.setdefault(held[id(tensor)], []).append((module._parameters, key))
        for name, values in self.timeline.items():
            self._put(name, values[0][1])
        return self

    def stepped(self, step: int, optimizer: Any) -> None:
        """Held step ``step`` (1 for the batch's first) of ``optimizer`` was reached: its parameters move on."""
        expected = self.earlier[step - 1][0]
        if optimizer is not expected:
            raise ValueError(
                f"training_step run again steps {type(optimizer).__name__} at its optimizer step {step}, where "
                f"training stepped {type(expected).__name__}: its optimizer steps depend on more than the batch and "
                "the random state, so gradwatch cannot tell which loss a step applies"
            )
        for name in self.earlier[step - 1][1]:
            following = next((value for at, value in self.timeline[name] if at > step), None)
            self._put(name, following)

    def __exit__(self, *exc: object) -> None:
        for name in self.timeline:
            self._put(name, None)

    def _put(self, name: str, value: Tensor | None) -> None:
        occupant = self.occupants[name]
        held = occupant if value is None else value.to(device=occupant.device, dtype=occupant.dtype)
        for table, key in self.slots.get(name, []):
            table[key] = held


def before_update(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """The values of the module's parameters that ``optimizer`` updates, by name, copied before its update (an entry of
    :data:`Earlier`)."""
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return {name: p.detach().clone() for name, p in module.named_parameters() if id(p) in ids}


def rewound(loss_fn: LossFn, module: nn.Module, earlier: Earlier) -> LossFn:
    """``loss_fn`` evaluated with the parameters of the ``earlier`` updates put back at their values before them: the
    loss of a window whose forward ran before those updates (another optimizer's step on the same backward)."""

    def at_the_backward(model: nn.Module, batch: Any) -> Tensor:
        with Rewind(module, earlier):
            return loss_fn(model, batch)

    return at_the_backward
