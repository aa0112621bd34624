"""The loss as one deterministic function of the parameters and the batch's floating inputs.

Every evaluation must be the same function: the same dropout masks (random state replayed), the same BatchNorm
statistics (buffers restored), no autocast, no TF32 (:mod:`.conditions`). :class:`LossEvaluator` provides the
reference gradient (``torch.autograd.grad``, which leaves ``.grad`` alone) and gradient-free evaluations at perturbed
points.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch.engine.distributed import collective as sharding
from gradwatch.engine.distributed.parameters import sharded_backward
from gradwatch.engine.function.backward import gradient, loss_gradient
from gradwatch.engine.function.batch import complex_inputs, floating_tensors, opaque_parts, replace_tensors
from gradwatch.engine.function.complex_params import autograd_tensor, checked_gradient, stored_value
from gradwatch.engine.function.dataflow import ReferenceFlow, unprobed_note
from gradwatch.engine.function.fidelity import Float64Fidelity
from gradwatch.engine.function.held import HeldDetaches
from gradwatch.engine.function.memory import ending_check_when_out_of_memory
from gradwatch.engine.function.reductions import Float64Reductions
from gradwatch.engine.function.state import TrainingState
from gradwatch.engine.function.substitution import OriginalsSeen, substituted
from gradwatch.engine.function.values import as_scalar_loss, dense, first_line
from gradwatch.engine.function.vectorizing import flat_linear, running_statistics_frozen
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import CheckAbandonedError
from gradwatch.errors import passes_fallbacks

LossFn = Callable[[nn.Module, Any], Tensor]
"""``loss_fn(model, batch) -> scalar Tensor``."""


@dataclass(frozen=True)
class Reference:
    """The loss and its autograd gradient at the unperturbed point: ``param_grads[i]`` ``None`` where parameter ``i``
    received none; ``input_grads`` only the inputs that received one."""

    loss: float
    param_grads: list[Tensor | None]
    input_grads: dict[str, Tensor]


class LossEvaluator:
    """Evaluates ``loss_fn(model, batch)`` as one deterministic function of the parameters ``params`` (``(name,
    parameter)`` pairs) and the floating inputs, under the captured training ``state``. Use it inside
    :func:`probe_conditions`.

    Parameters are perturbed in place by the caller (and restored by it); floating inputs through the working copies in
    :attr:`inputs`, which the loss sees in place of the batch's own tensors. ``float64_reductions``: accumulate the
    loss's final reductions in float64 in the gradient-free evaluations. ``held``: the values the loss detaches that
    every evaluation after the first reference holds at that reference's (:mod:`.held`); none by default.
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        loss_fn: LossFn,
        params: list[tuple[str, Tensor]],
        state: TrainingState,
        *,
        float64_reductions: bool = True,
        held: HeldDetaches | None = None,
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.params = params
        self.state = state
        self.float64_reductions = float64_reductions
        self.notes: list[Note] = []
        self.held = held or HeldDetaches()
        self.held.notes = self.notes
        self.inputs_refused = False
        """Whether the loss refused displaced inputs: the check then makes no input probe and shifts no input."""
        self.n_forward = 0
        self.n_backward = 0
        self.n_passes = 0
        self.saved_elements = 0
        """Elements autograd saved for the backward of the reference pass: about the activations of one evaluation."""
        self._batch = batch
        self._native = floating_tensors(batch)  # the inputs evaluated, in their own dtype (shifted: see moved_inputs)
        self._use_inputs(self._native)
        self._reductions_verified = False
        self._float64_inputs = False
        self._grad_mode_evaluations = False
        self.native_dtype = max((p.dtype for _, p in params), key=lambda d: torch.finfo(d).eps, default=torch.float32)
        """The dtype the model trains in (the least precise of its checked parameters)."""
        self._fidelity: Float64Fidelity | None = Float64Fidelity(self.native_dtype)
        self._fidelity_settled = False
        self.data_dependent: str | None = None
        """What the loss does that vmap refuses, as the reference pass saw it (``"nonzero()"``), or ``None``."""
        self.refused_function: str | None = None
        """An ``autograd.Function`` in the reference's graph that vmap refuses (its class name), or ``None``."""
        self.watch: OriginalsSeen | None = None
        """A mode active around the loss of gradient-free evaluations (the float64 trial's), run by the fidelity mode
        where that one is active (:meth:`_watching`)."""
        self.refused_by: type[nn.Module] | None = None
        """The class of the module whose forward raised in the float64 trial (a kernel refusing float64), if any."""
        self.value_dtype = torch.float32
        """The dtype of the last loss value (float64 when the float64 reductions reached the final loss)."""
        self.probed_in = "native"  # an applied check's probes: "float64" on float64 storage (not float64 reductions)

    def _reset_inputs(self) -> None:
        """Undo any in-place change the loss function made to its inputs in the previous evaluation."""
        versions = self._versions
        changed = [(path, tensor) for path, tensor in self.inputs.items() if tensor._version != versions[path]]
        if not changed:  # the usual case: no grad mode to enter and leave at every evaluation
            return
        with torch.no_grad():
            for path, tensor in changed:
                tensor.copy_(self._pristine[path])
                versions[path] = tensor._version

    def mark_inputs_current(self) -> None:
        """Record the working inputs as they are now, after the caller perturbed or restored one of them."""
        self._versions = {path: tensor._version for path, tensor in self.inputs.items()}

    @contextlib.contextmanager
    def _evaluation(
        self, grad: bool, points: int = 1, differentiated: bool = False
    ) -> Iterator[Float64Fidelity | None]:
        """One pass evaluating the loss at ``points`` points (one, if it raises): the inputs reset, the random state
        replayed, and what the loss changed undone afterwards (after the backward pass of a ``differentiated`` one:
        BatchNorm keeps its buffers for it). Yields the fidelity mode active during it, if any."""
        self._reset_inputs()
        completed = False
        try:
            self.state.before_evaluation()
            self.n_passes += 1
            self.n_forward += 1
            active = self._fidelity if self._float64_inputs else None
            fidelity = active or contextlib.nullcontext()
            # outside a sharded check its evaluation context does nothing: not entered
            sharded = sharding.evaluation() if sharding.active() is not None else contextlib.nullcontext()
            with sharded, torch.set_grad_enabled(grad), fidelity, ending_check_when_out_of_memory():
                yield active
            self.n_forward += points - 1
            if active is not None and not self._fidelity_settled:
                # the first float64 evaluation: keep the fidelity mode if the loss needed it (with a note), drop it
                # otherwise (it would only cost its dispatch)
                self._fidelity_settled = True
                self._fidelity = active if active.acted else None
                self.notes += active.notes()
            if differentiated:
                self.state.skip_unused_generators()
            completed = True
        finally:
            self.state.after_evaluation(completed)

    def reference(self, with_inputs: bool = True, vectorising: bool = True) -> Reference:
        """Loss and autograd gradient at the current point, with ``with_inputs`` with respect to the floating inputs too
        (where the loss cannot be differentiated with respect to them, the parameters' alone, with a note).
        ``vectorising=False``: no vectorised pass follows, so neither the dataflow watch nor the saved count runs."""
        for path in opaque_parts(self._batch) if with_inputs else ():
            self.notes.append(
                Note(NoteCode.BATCH_OPAQUE, f"{path} holds tensors in an object gradwatch cannot look into: not probed")
            )
        for path in complex_inputs(self._batch) if with_inputs else ():
            self.notes.append(Note(NoteCode.BATCH_OPAQUE, f"{path} is a complex input: not probed, not promoted"))
        if with_inputs and self.inputs:
            try:
                reference = self._reference(with_inputs=True)
            except Exception as error:
                if passes_fallbacks(error):
                    raise
                # the loss may refuse inputs that require grad (a metric asserting `not target.requires_grad`)
                self.notes.append(
                    Note(
                        NoteCode.INPUT_PROBES_REFUSED,
                        "input probes skipped: the loss cannot be differentiated with respect to its inputs "
                        f"({type(error).__name__}: {first_line(error)})",
                    )
                )
            else:
                return reference
        return self._reference(with_inputs=False, vectorising=vectorising)

    def _reference(self, with_inputs: bool, vectorising: bool = True) -> Reference:
        leaves = (
            {path: tensor.detach().requires_grad_(True) for path, tensor in self.inputs.items()} if with_inputs else {}
        )
        batch = replace_tensors(self._batch, leaves) if with_inputs else self._working_batch
        self.saved_elements = 0
        watch = ReferenceFlow(leaves, self.held.in_scope)
        counted = torch.autograd.graph.saved_tensors_hooks(self._count_saved, lambda tensor: tensor)
        with self._evaluation(grad=True, differentiated=True):
            with contextlib.ExitStack() as stack:  # the forward alone
                for context in (counted, watch) if vectorising or with_inputs else ():
                    stack.enter_context(context)
                stack.enter_context(self.held.evaluating())
                loss = as_scalar_loss(self.loss_fn(self.model, batch))
            wrt = [autograd_tensor(p) for _, p in self.params] + list(leaves.values())
            if not loss.requires_grad:
                raise ValueError(
                    "loss_fn returned a tensor that does not require grad: the loss does not depend on any "
                    "trainable parameter or floating input through autograd (computed under torch.no_grad()?)"
                )
            collective = sharding.active()
            with self.held.differentiating():
                if collective is None:
                    value = float(loss.detach())
                    grads: list[Tensor | None] = loss_gradient(loss, wrt)
                else:
                    params = [p for _, p in self.params]
                    value, sharded = sharded_backward(collective, self.model, loss, params, leaves)
                    grads = list(sharded)
            self.n_backward += 1
            self.held.differentiated()
        n_params = len(self.params)
        grads = [dense(grad) for grad in grads]
        grads[:n_params] = [checked_gradient(p, g) for (_, p), g in zip(self.params, grads, strict=False)]
        detached = watch.detached
        self.data_dependent = self.data_dependent or watch.data_dependent
        input_grads = {
            path: grad
            for path, grad in zip(leaves, grads[n_params:], strict=True)
            if grad is not None and path not in detached
        }
        note = unprobed_note(detached)
        if note is not None:
            self.notes.append(Note(NoteCode.INPUTS_DETACHED, note))
        return Reference(value, list(grads[:n_params]), input_grads)

    def gradients_wrt(self, created: Callable[[], Sequence[Tensor]]) -> tuple[float, list[Tensor | None]]:
        """The loss at the current point and its gradient with respect to tensors the forward pass creates (read by
        ``created()`` after the forward: zero leaves hooks add to activations; ``None`` for one the loss ignores)."""
        with self._evaluation(grad=True, differentiated=True):
            with self.held.evaluating():
                loss = as_scalar_loss(self.loss_fn(self.model, self._working_batch))
            wanted = list(created())
            needed = [t for t in wanted if t.requires_grad] if loss.requires_grad else []
            with self.held.differentiating():
                found = gradient(loss, needed)
            self.n_backward += 1
            self.held.differentiated()
        by_identity = {id(t): g for t, g in zip(needed, found, strict=True)}
        grads = [by_identity.get(id(t)) for t in wanted]
        return float(loss.detach()), [None if g is None else dense(g) for g in grads]

    def _count_saved(self, tensor: Tensor) -> Tensor:
        base = tensor._base if tensor._base is not None else tensor  # parameters, their views (W.T) and inputs are
        if not (base.is_leaf and base.requires_grad):  # not activations
            self.saved_elements += tensor.numel()
        return tensor

    def losses(self, param_stacks: dict[str, Tensor], input_stacks: dict[str, Tensor], points: int) -> list[float]:
        """The loss at ``points`` points in one forward pass, vectorised with ``torch.func.vmap``.

        ``param_stacks`` (by parameter name) and ``input_stacks`` (by input path) hold the tensors that differ between
        the points, one slice per point along a new leading dimension. Random draws are shared by all points
        (``randomness="same"``) and replayed, so each point sees the dropout masks an evaluation on its own would.
        Raises whatever vmap or the loss raises on code it cannot vectorise.
        """
        model, loss_fn = self.model, self.loss_fn
        by_name = dict(self.params)

        def loss_at(params: dict[str, Tensor], inputs: dict[str, Tensor]) -> Tensor:
            batch = replace_tensors(self._batch, {**self.inputs, **inputs})
            moved = {id(autograd_tensor(by_name[name])): stored_value(by_name[name], v) for name, v in params.items()}
            originals = {id(autograd_tensor(by_name[name])): name for name in params}  # those differing by point
            watch = self._watching(OriginalsSeen(originals), fidelity)  # one mode, where the fidelity mode is active
            with substituted(model, moved), watch, self.held.evaluating():
                return as_scalar_loss(loss_fn(model, batch))

        with self._evaluation(grad=False, points=points) as fidelity, running_statistics_frozen(model), flat_linear():
            values = torch.func.vmap(loss_at, randomness="same")(param_stacks, input_stacks)
        self.value_dtype = values.dtype
        return [self.held.value_of(value) for value in values.detach().double().tolist()]

    def loss(self) -> float:
        """The loss at the current point, without building a graph. The first call of a check verifies the float64
        reductions against the native ones; where they disagree (or the model fails with them) they are switched off
        for the rest of the check, with a note, and the loss is evaluated again natively."""
        if not self.float64_reductions or self._float64_inputs:
            # on float64 storage every sum is float64 already: the mode would only cost its per-operation dispatch
            return self._forward(contextlib.nullcontext())
        verify = not self._reductions_verified
        mode = Float64Reductions(verify=verify)
        try:
            value = self._forward(mode)
        except Exception as error:
            if passes_fallbacks(error) or not verify:
                raise
            # the model may not cope with a float64 scalar where it expects float32; the native run decides
            mode.mismatch = f"the loss raised {type(error).__name__}: {error}"
        self._reductions_verified = True
        if not sharding.any_rank([mode.mismatch is not None])[0]:
            return value
        if mode.mismatch is None:
            mode.mismatch = "they differ on another rank"
        self.float64_reductions = False
        self.notes.append(Note(NoteCode.FLOAT64_REDUCTIONS_OFF, f"float64 reductions switched off ({mode.mismatch})"))
        return self._forward(contextlib.nullcontext())

    def native_loss(self) -> float:
        """The loss at the current point computed exactly as the model computes it (no float64 reductions)."""
        return self._forward(contextlib.nullcontext())

    def _forward(self, mode: contextlib.AbstractContextManager[Any]) -> float:
        if self._grad_mode_evaluations:
            return self._forward_once(mode)
        try:
            return self._forward_once(mode)
        except CheckAbandonedError:
            raise
        except RuntimeError as error:
            # a loss that differentiates inside itself (a gradient penalty, a PDE residual: torch.autograd.grad with
            # create_graph=True) needs autograd recording; it raises under torch.no_grad()
            try:
                value = self._forward_once(mode, grad=True)
            except Exception:
                raise error from None
            self.use_grad_mode()
            self.notes.append(
                Note(
                    NoteCode.DOUBLE_BACKWARD,
                    "evaluations run with autograd recording: the loss differentiates inside itself "
                    f"(under torch.no_grad() it raised {type(error).__name__}: {first_line(error)})",
                )
            )
            return value

    def _forward_once(self, mode: contextlib.AbstractContextManager[Any], grad: bool | None = None) -> float:
        grad = self._grad_mode_evaluations if grad is None else grad
        with (
            self._evaluation(grad=grad) as fidelity,
            mode,
            contextlib.nullcontext() if self.watch is None else self._watching(self.watch, fidelity),
            self.held.evaluating(),
        ):
            value = as_scalar_loss(self.loss_fn(self.model, self._working_batch))
        self.value_dtype = value.dtype
        return sharding.global_loss(self.held.value_of(float(value.detach().double())))

    @staticmethod
    def _watching(watch: OriginalsSeen, fidelity: Float64Fidelity | None) -> contextlib.AbstractContextManager[Any]:
        """The :attr:`watch` around the loss: its own mode, or where the ``fidelity`` mode is active (the float64
        trial), its check run by that mode for the same span: each operation dispatched once, not through two stacked
        modes (~5 µs each), its originals checked before the fidelity mode acts on it as when stacked."""
        return watch if fidelity is None else _run_by(fidelity, watch)

    def use_float64_inputs(self) -> None:
        """Evaluate from now on with float64 copies of the floating inputs (for float64 probes)."""
        self._float64_inputs = True
        self._use_inputs({path: t.detach().to(torch.float64) for path, t in self._native.items()})

    def use_native_inputs(self) -> None:
        """Evaluate from now on with copies of the batch's own floating inputs (the default)."""
        self._float64_inputs = False
        self._use_inputs(self._native)

    @contextlib.contextmanager
    def moved_inputs(self, moved: dict[str, Tensor]) -> Iterator[None]:
        """Evaluate at other floating inputs (``moved``, by path, in the inputs' own dtype) for the duration."""
        saved = self._native
        self._native = {**saved, **moved}
        self._use_inputs(self._native)
        try:
            yield
        finally:
            self._native = saved
            self._use_inputs(self._native)

    def _use_inputs(self, pristine: dict[str, Tensor]) -> None:
        self._pristine = pristine
        self.inputs = {path: tensor.detach().clone() for path, tensor in pristine.items()}
        self._working_batch = replace_tensors(self._batch, self.inputs)
        self.mark_inputs_current()

    @property
    def grad_mode(self) -> bool:
        """Whether evaluations record autograd graphs (see :meth:`use_grad_mode`)."""
        return self._grad_mode_evaluations

    def use_grad_mode(self) -> None:
        """Evaluate with autograd recording from now on (kernels or random draws that differ in ``no_grad``)."""
        self._grad_mode_evaluations = True


@contextlib.contextmanager
def _run_by(fidelity: Float64Fidelity, watch: OriginalsSeen) -> Iterator[None]:
    """``watch``'s check run by the active ``fidelity`` mode at each operation for the duration."""
    fidelity.watch = watch.check
    try:
        yield
    finally:
        fidelity.watch = None
