"""The window's gradient computed again along other paths: what a noise floor and an attribution compare.

Each function runs one forward and one ``torch.autograd.grad`` of the window's loss (leaving ``.grad`` alone), the
random states replayed and the buffers restored by the check's :class:`TrainingState`, under chosen conditions: eager
float32 (:func:`eager_gradient`, or with a 16-bit autocast path's rounding emulated), on float64 copies with the
parameters' gradient hooks applied (:func:`float64_gradient`), or on the training's own path
with one element of it switched off or the loss scaled (:func:`path_gradient`).

Under DDP (a ``group``) every result is the mean over the ranks by a plain all-reduce of gradwatch's own: the
training's reduction (and its communication hooks) is what the ``"reduction"`` attribution leaves out. Under FSDP2
each result is this rank's shard of the mean, reduced by FSDP's own reduce-scatter in ``backward`` (autograd cannot
differentiate with respect to a shard); :func:`float64_gradient` is not available there (FSDP gathers parameters in
their own dtype).

**A 16-bit autocast path's rounding** (:class:`AutocastRounding`): a correct bf16-autocast gradient differs from the
exact derivative by its rounding, a wrong one by its bug; the check needs to know how far a *correct* one is off
without asking the path's own kernels, which are what is checked. In the spirit of flash-attention's tests (a kernel's
error judged against a same-precision PyTorch reference's), :class:`AutocastRounding` builds that reference from
float32 kernels the float32 checks vouch for: below autograd (a ``TorchDispatchMode``, which sees the backward's
operations too) it rounds values to the autocast dtype where autocast would hold them in 16 bits:

* the operands and results of the operations autocast runs in 16 bits (matrix products, convolutions and their
  backward, attention);
* the results of operations on such 16-bit values (activations, dropout, norms, their backward), except where a
  float32 tensor takes part in an elementwise operation (type promotion makes the result float32, as under autocast)
  and except the losses autocast runs in float32.

Its formulas are float32 autograd's (a backward wrong only under autocast is not in it) and its rounding autocast's,
so its distance from the float32 gradient is the noise floor of a correct gradient on the path. Where it cannot tell (a
mixed-dtype norm's weight gradient) it rounds, which can only raise the floor.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from gradwatch.engine.distributed import collective as sharding
from gradwatch.engine.distributed.parameters import sharded_backward
from gradwatch.engine.function.batch import floating_tensors, replace_tensors
from gradwatch.engine.function.complex_params import (
    autograd_tensor,
    checked_gradient,
    parameter_hooks,
    with_parameter_hooks,
)
from gradwatch.engine.function.conditions import (
    autocast_disabled,
    autocast_held_off,
    compiler_disabled,
    full_float32_precision,
    reentrant_checkpoints_run_non_reentrant,
)
from gradwatch.engine.function.evaluation import LossFn, as_scalar_loss
from gradwatch.engine.function.precision import float64_storage, substitute_of
from gradwatch.engine.function.state import TrainingState

Gradient = list[Tensor]
"""One tensor per checked parameter (zeros where autograd gave none)."""

R = TypeVar("R")

_aten = torch.ops.aten
_LOWER_PRECISION = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.addbmm, _aten.convolution,
                    _aten.convolution_backward, _aten._scaled_dot_product_flash_attention_for_cpu,
                    _aten._scaled_dot_product_flash_attention_for_cpu_backward}  # fmt: skip
"""The operations autocast runs in 16 bits, as the dispatcher sees them below autograd (``linear`` and ``matmul``
decompose into the matrix products; convolutions of every dimension into ``convolution``)."""

_FLOAT32 = {_aten.nll_loss_forward, _aten.nll_loss2d_forward, _aten.mse_loss, _aten.l1_loss, _aten.smooth_l1_loss,
            _aten.huber_loss, _aten.binary_cross_entropy, _aten.binary_cross_entropy_with_logits, _aten.kl_div,
            _aten._log_softmax, _aten._softmax}  # fmt: skip
"""Losses (and the softmaxes they start with) that autocast computes in float32."""

_PROMOTING = {_aten.add, _aten.sub, _aten.mul, _aten.div, _aten.where, _aten.addcmul, _aten.addcdiv, _aten.lerp,
              _aten.maximum, _aten.minimum, _aten.cat, _aten.stack}  # fmt: skip
"""Operations whose result is float32 as soon as one float32 tensor (not a 0-dim scalar) takes part."""


def _floats(values: Any, found: list[Tensor] | None = None) -> list[Tensor]:
    """The floating tensors among ``values`` (an operation's arguments or results), in ``tree_flatten``'s order: walked
    by hand through tuples, lists and dicts, pytree's walk for anything else (for every operation, pytree's walk cost
    more than the operation)."""
    found = [] if found is None else found
    if isinstance(values, Tensor):
        if values.is_floating_point():
            found.append(values)
    elif isinstance(values, (tuple, list)):
        for value in values:
            _floats(value, found)
    elif isinstance(values, dict):
        for value in values.values():
            _floats(value, found)
    elif not isinstance(values, _ATOMS) and values is not None:
        found += [v for v in tree_flatten(values)[0] if isinstance(v, Tensor) and v.is_floating_point()]
    return found


def _mapped(function: Any, values: Any) -> Any:
    """``tree_map(function, values)``, by hand through plain tuples, lists and dicts (see :func:`_floats`)."""
    if isinstance(values, Tensor):
        return function(values)
    kind = type(values)
    if kind is tuple or kind is list:
        return kind(_mapped(function, value) for value in values)
    if kind is dict:
        return {key: _mapped(function, value) for key, value in values.items()}
    if values is None or isinstance(values, _ATOMS):
        return values
    return tree_map(function, values)


_ATOMS = (bool, int, float, complex, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


class AutocastRounding(TorchDispatchMode):
    """Emulates the rounding of autocast to ``dtype`` (``torch.bfloat16`` or ``torch.float16``) on float32 kernels."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.low: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """The tensors autocast would hold in ``dtype``."""

    def _round(self, value: Any) -> Any:
        if isinstance(value, Tensor) and value.dtype in (torch.float32, torch.float64):
            rounded = value.to(self.dtype).to(value.dtype)
            self.low[rounded] = True
            return rounded
        return value

    def _held_low(self, func: Any, args: Any) -> bool:
        floats = _floats(args)
        if not floats:
            return False
        if func.overloadpacket in _PROMOTING:
            return all(t in self.low or t.dim() == 0 for t in floats) and any(t in self.low for t in floats)
        return floats[0] in self.low

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _LOWER_PRECISION:
            args, kwargs = _mapped(self._round, (args, kwargs))
            return _mapped(self._round, func(*args, **kwargs))
        if packet in _FLOAT32 or not self._held_low(func, (args, kwargs)):
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if func._schema.is_mutable:  # in place: round the mutated tensors where they are
            for tensor in _floats(out):
                tensor.copy_(tensor.to(self.dtype))
                self.low[tensor] = True
            return out
        return _mapped(self._round, out)


def _gradient(model: nn.Module, batches: Any, loss_fn: LossFn, wrt: Sequence[Tensor], state: TrainingState, *,
              group: Any, scale: float = 1.0,
              taken: Mapping[int, Callable[[Tensor], None]] | None = None) -> tuple[float, Gradient]:  # fmt: skip
    """The loss and gradient of ``wrt``; the gradient of each index of ``taken`` handed to its function as autograd
    makes it (a tensor hook: the same tensor :func:`torch.autograd.grad` returns), a zero of no memory in its place
    (one such gradient alive at a time, not all of them: see :func:`float64_reduced`)."""
    completed = False
    found: list[Tensor | None]
    collective = sharding.active()
    taken = taken or {}
    assert not taken or (collective is None and group is None and scale == 1.0), "taken as the gradient is final"
    handles = [autograd_tensor(wrt[i]).register_hook(_taker(wrt[i], take)) for i, take in taken.items()]
    state.before_evaluation()
    try:
        # a reentrant activation checkpoint refuses torch.autograd.grad, which leaves .grad alone: run it non-reentrant
        with sharding.evaluation(), torch.enable_grad(), reentrant_checkpoints_run_non_reentrant():
            loss = as_scalar_loss(loss_fn(model, batches))
            scaled = loss * scale if scale != 1.0 else loss
            if collective is None:
                value = float(loss.detach())
                # a complex parameter's real view: autograd differentiates the complex tensor behind it
                raw = torch.autograd.grad(scaled, [autograd_tensor(t) for t in wrt], allow_unused=True)
                found = [checked_gradient(t, g) for t, g in zip(wrt, raw, strict=True)]
                del raw
            else:  # FSDP reduces onto the shards in its backward hooks: the mean over the ranks, its own reduction
                value, found = sharded_backward(collective, model, scaled, wrt, {})
                value /= scale
        completed = True
    finally:
        for handle in handles:
            handle.remove()
        state.after_evaluation(completed)
    grads = []
    kept = scale == 1.0 and collective is None  # autograd's own result, not FSDP's gradient buffer: no copy
    for i, t in enumerate(wrt):  # each copy made as the gradient it divides is let go
        g, found[i] = found[i], None
        if g is None:
            g = torch.zeros_like(t)
            if i in taken:  # no gradient from autograd, no hook called
                taken[i](g)
        elif i not in taken:
            g = _own(g, kept, scale)
        grads.append(g)
    return value, rank_mean(grads, group)


def _own(grad: Tensor, kept: bool, scale: float) -> Tensor:
    """Autograd's gradient as :func:`_gradient` returns it: itself where ``kept`` (no scale, no FSDP buffer) and
    contiguous, else divided by ``scale`` (a strided result, an expanded one say, laid out as the division lays it
    out)."""
    return grad.detach() if kept and grad.is_contiguous() else grad.detach() / scale


def _taker(tensor: Tensor, take: Callable[[Tensor], None]) -> Callable[[Tensor], Tensor]:
    """The tensor hook that hands the checked ``tensor``'s gradient to ``take`` as :func:`_gradient` would return it,
    and leaves autograd a zero of no memory (expanded) to hold in its place."""

    def hook(grad: Tensor) -> Tensor:
        own = checked_gradient(tensor, grad)
        assert own is not None
        take(_own(own, True, 1.0))
        return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)

    return hook


def rank_means(values: list[float], group: Any) -> list[float]:
    """``values`` averaged over the ranks of ``group`` in float64 (as they are without one)."""
    if group is None or not values:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, group=group)
    return (tensor / dist.get_world_size(group)).tolist()


def rank_mean(grads: Gradient, group: Any) -> Gradient:
    """The mean over the ranks of ``group`` (a plain all-reduce); ``grads`` without one."""
    if group is None:
        return grads
    world = dist.get_world_size(group)
    reduced = []
    for grad in grads:
        copy = grad.clone()
        dist.all_reduce(copy, group=group)
        reduced.append(copy / world)
    return reduced


@contextlib.contextmanager
def exact_conditions(ieee: bool = True) -> Iterator[list[tuple[str, torch.dtype]]]:
    """The conditions of the check's own evaluations: outside autocast (also where the loss enters it), full-precision
    float32 kernels (not ``ieee``: as training set them, TF32 where it is on), compiled code run eagerly, activation
    checkpoints non-reentrant; dropout left as training calls it, so that it draws the training's masks. Yields the
    autocast regions the loss tried to enter (:func:`~gradwatch.engine.function.conditions.autocast_held_off`)."""
    with (
        autocast_held_off() as entered,
        full_float32_precision() if ieee else contextlib.nullcontext(),
        compiler_disabled(),
        reentrant_checkpoints_run_non_reentrant(),
    ):
        yield entered


def eager_gradient(model: nn.Module, batches: Any, loss_fn: LossFn, params: Sequence[Tensor], state: TrainingState, *,
                   group: Any = None, scale: float = 1.0, ieee: bool = True,
                   emulated: torch.dtype | None = None) -> Gradient:  # fmt: skip
    """Eager float32 autograd of the window's loss, outside autocast; with a ``scale``, of the loss times it, divided by
    it (the same gradient, rounded otherwise); not ``ieee``, with the float32 kernels training's settings choose;
    ``emulated``, with the storage rounding of autocast to that dtype (:class:`AutocastRounding`)."""
    with exact_conditions(ieee), AutocastRounding(emulated) if emulated else contextlib.nullcontext():
        return _gradient(model, batches, loss_fn, params, state, group=group, scale=scale)[1]


def float64_gradient(model: nn.Module, batches: Any, loss_fn: LossFn, params: Sequence[Tensor], state: TrainingState,
                     *, group: Any = None) -> Gradient:  # fmt: skip
    """Eager autograd on float64 storage, the parameters' own gradient hooks (``param.register_hook``) applied to the
    result: a hook is part of the gradient being checked."""
    return float64_reduced(model, batches, loss_fn, params, state, lambda _, grad: grad, group=group)


def float64_reduced(model: nn.Module, batches: Any, loss_fn: LossFn, params: Sequence[Tensor], state: TrainingState,
                    reduce: Callable[[int, Tensor], R], *, group: Any = None) -> list[R]:  # fmt: skip
    """``reduce(i, g_i)`` of each tensor's :func:`float64_gradient`, bit for bit. Where nothing follows autograd (no
    parameter hook, no mean over ranks, a tensor checked once, a substitute of gradwatch's: no hook put on a float64
    parameter, the user's) each gradient is reduced as autograd makes it, so that one float64 gradient is alive at a
    time, not the model's (4x the float32 parameters with the float64 model)."""
    inputs = {path: t.detach().double() for path, t in floating_tensors(batches).items()}
    reduced: dict[int, R] = {}
    with autocast_disabled(), compiler_disabled(), float64_storage(model) as substitutes:
        wrt = [substitute_of(p, substitutes) for p in params]
        for tensor in wrt:
            autograd_tensor(tensor).requires_grad_(True)
        taken: dict[int, Callable[[Tensor], None]] = {}
        if group is None and sharding.active() is None:
            once = Counter(id(autograd_tensor(t)) for t in wrt)
            for i, (param, tensor) in enumerate(zip(params, wrt, strict=True)):
                own = autograd_tensor(tensor) is not autograd_tensor(param)  # a substitute: no hook on the user's
                if own and once[id(autograd_tensor(tensor))] == 1 and not parameter_hooks(param):
                    taken[i] = functools.partial(_store, reduced, i, reduce)
        grads = _gradient(model, replace_tensors(batches, inputs), loss_fn, wrt, state, group=None, taken=taken)[1]
    hooked = [
        grad if i in taken else with_parameter_hooks(param, grad)
        for i, (param, grad) in enumerate(zip(params, grads, strict=True))
    ]
    del grads
    mean = rank_mean(hooked, group)
    del hooked
    return [reduced[i] if i in taken else reduce(i, grad) for i, grad in enumerate(mean)]


def _store(reduced: dict[int, R], i: int, reduce: Callable[[int, Tensor], R], grad: Tensor) -> None:
    reduced[i] = reduce(i, grad)


def path_gradient(model: nn.Module, batches: Any, loss_fn: LossFn, params: Sequence[Tensor], state: TrainingState, *,
                  compiled: bool = True, autocast: bool = True, group: Any = None,
                  scale: float = 1.0) -> tuple[float, Gradient]:  # fmt: skip
    """The window's loss and gradient as the training computes them, compiled code run eagerly if not ``compiled``,
    every autocast region held off if not ``autocast``; with a ``scale``, the gradient of the loss times it, divided by
    it (rounded otherwise on a 16-bit path: :func:`~.verdict.floors`)."""
    with contextlib.ExitStack() as stack:
        if not compiled:
            stack.enter_context(compiler_disabled())
        if not autocast:
            stack.enter_context(autocast_held_off())
        return _gradient(model, batches, loss_fn, params, state, group=group, scale=scale)
