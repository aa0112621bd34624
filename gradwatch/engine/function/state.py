"""Exact snapshot and restore of everything a gradient check could disturb in a training run.

Each of a check's dozens of evaluations would otherwise draw fresh dropout masks, update BatchNorm running statistics
and advance the random generators. :class:`TrainingState` saves the random states (torch CPU and CUDA, Python's
``random``, NumPy's), buffers, ``.grad`` tensors and train/eval modes once and puts them back bit-exactly. Parameters
are restored by the probes that perturb them, by copying saved values back (never by subtracting the step, which
float32 does not round-trip); what the loss does to the model by the :class:`ModelGuard`, to the optimizers by the
:class:`OptimizerGuard`, to the rest of the module tree by the :class:`Sandbox`.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch.engine.function.backward import LossCallsBackwardError, loss_calls_backward
from gradwatch.engine.function.guard import ModelGuard, plain
from gradwatch.engine.function.optimizers import OptimizerGuard
from gradwatch.engine.function.sandbox import Sandbox


@dataclass(frozen=True)
class _SavedBuffer:
    module: nn.Module
    name: str
    tensor: Tensor
    value: Tensor


def capture_rng() -> dict[str, Any]:
    """The state of every global random generator (torch CPU and CUDA, Python's ``random``, NumPy's), as a
    :class:`TrainingState` saves it: what a loop records before a micro-batch so a check can replay its dropout."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def set_rng(state: dict[str, Any], generators: Collection[str] | None = None) -> None:
    """Set every global random generator to ``state`` (from :func:`capture_rng`); only those named in
    ``generators``, if given."""
    for name, value in state.items():
        if generators is None or name in generators:
            _SETTERS[name](value)


def unchanged(name: str, saved: Any) -> bool:
    """Whether the global generator ``name`` (a key of :func:`capture_rng`'s state) is still in the ``saved`` state."""
    if name == "python":
        return random.getstate() == saved
    if name == "numpy":
        current = sys.modules["numpy"].random.get_state()
        return all(bool((a == b).all()) if hasattr(a, "all") else a == b for a, b in zip(current, saved, strict=True))
    if name == "cuda":
        return all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), saved, strict=True))
    return torch.equal(torch.get_rng_state(), saved)


_SETTERS: dict[str, Callable[[Any], None]] = {
    "torch": torch.set_rng_state,
    "python": random.setstate,
    "cuda": lambda value: torch.cuda.set_rng_state_all(value),
    "numpy": lambda value: sys.modules["numpy"].random.set_state(value),
}


class TrainingState:
    """The random states, buffers, ``.grad`` tensors, modes and user state of a model, saved so a check can leave no
    trace.

    Use :meth:`capture` before the first evaluation, :meth:`before_evaluation` and :meth:`after_evaluation` around
    every evaluation, and :meth:`restore` once at the end, in a ``finally`` block. The rest of the module tree is the
    :attr:`sandbox`'s, the model's parameters and structure the :attr:`guard`'s, the optimizers the
    :attr:`optimizers`'. Every parameter's ``.grad`` is held here (set to ``None`` meanwhile) and the very same tensor
    put back: nothing the loss does during the check (even ``backward()``) can change them.
    """

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        self._rng = capture_rng()
        self._replayed = set(self._rng)  # the generators replay_rng sets
        modules = list(model.modules())  # the tree walked once
        self._modes = [(module, module.training) for module in modules]
        self._grads = [(p, p.grad) for p in model.parameters()]
        self._buffers: list[_SavedBuffer] = []
        saved_values: dict[int, Tensor] = {}
        for module in modules:
            for name, buffer in module.named_buffers(recurse=False):
                # a buffer shared between modules is saved once and restored through each owner
                value = saved_values.setdefault(id(buffer), buffer.detach().clone())
                self._buffers.append(_SavedBuffer(module, name, buffer, value))
        for parameter, _ in self._grads:
            parameter.grad = None
        tensors = {id(p) for p, _ in self._grads} | {id(b) for b in model.buffers()}
        self.sandbox = Sandbox(model, exclude=tensors)
        self.guard = ModelGuard(model)
        self.optimizers = OptimizerGuard(optimizers)

    @classmethod
    def capture(cls, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> TrainingState:
        """Save the state of ``model``, of ``optimizers`` and of the global random generators."""
        return cls(model, optimizers)

    def before_evaluation(self) -> None:
        """Before an evaluation of the loss: replay the random state, save what the evaluation may change."""
        self.replay_rng()
        self.guard.before_evaluation()

    def replay_rng(self) -> None:
        """Reset the random generators to their captured state (all of them, or after :meth:`skip_unused_generators`
        those the loss draws from)."""
        set_rng(self._rng, self._replayed)

    def skip_unused_generators(self) -> None:
        """After an evaluation: stop replaying the generators it left untouched (setting NumPy's state costs ~70 µs, a
        small model's forward); :meth:`restore` still resets every generator."""
        self._replayed = {name for name in self._replayed if not unchanged(name, self._rng[name])}

    @property
    def draws_random(self) -> bool:
        """Whether the evaluations so far drew from a random generator (known after the first: see
        :meth:`skip_unused_generators`)."""
        return bool(self._replayed)

    def restore_buffers(self) -> None:
        """Undo any change to the buffers since the capture: every one is copied back (BatchNorm's CPU kernel updates
        its running statistics without bumping their version counters)."""
        if not self._buffers:
            return  # most models: no grad mode to enter and leave after every evaluation
        with torch.no_grad():
            for saved in self._buffers:
                if getattr(saved.module, saved.name, None) is not saved.tensor:
                    setattr(saved.module, saved.name, saved.tensor)
                saved.tensor.copy_(saved.value)

    def after_evaluation(self, completed: bool = True) -> None:
        """Undo what one evaluation changed: buffers, and the user state the loss changes (:class:`Sandbox`): after the
        first completed one, just what it changed; after one that raised, everything."""
        self.restore_buffers()
        self.guard.after_evaluation()
        if not completed:
            self.sandbox.restore()
        elif self.sandbox.settled:
            self.sandbox.restore_watched()
        else:
            self.sandbox.settle()
        self._refuse_backward()

    @plain
    def _refuse_backward(self) -> None:
        """A ``.grad`` that appeared during an evaluation: the loss called ``backward()`` itself."""
        touched = [parameter for parameter, _ in self._grads if parameter.grad is not None]
        if not touched:
            return
        for parameter in touched:
            parameter.grad = None
        stepped = self.optimizers.stepped
        also = f", and it stepped {stepped[0]}" if stepped else ""
        raise LossCallsBackwardError(loss_calls_backward(f"the parameters' .grad changed while it was evaluated{also}"))

    def restore(self) -> None:
        """Put everything back exactly as captured, all of it even when restoring one part raises (raised after)."""
        errors: list[Exception] = []
        for part in (self.guard.restore, self.optimizers.restore, self.sandbox.restore, self.restore_buffers):
            try:
                part()
            except Exception as error:  # keep restoring the rest
                errors.append(error)
        for module, training in self._modes:
            module.training = training
        for parameter, grad in self._grads:
            parameter.grad = grad
        set_rng(self._rng)
        if errors:
            raise errors[0]

    def unrestorable(self, in_sandbox: list[str] | None = None) -> list[str]:
        """What the loss changed that could not be put back, named (``in_sandbox``: the sandbox's part, if known)."""
        sandbox = self.sandbox.unrestorable() if in_sandbox is None else in_sandbox
        return sandbox + self.guard.unrestorable() + self.optimizers.unrestorable()
