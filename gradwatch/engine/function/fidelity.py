"""Float64 evaluation of a lower-precision model that computes the same function, only more precisely.

Float64 probes evaluate a float32 model on float64 copies of its parameters and inputs. Three habits of real models
make that another function:

* **Casts down inside the model.** Hugging Face causal LMs compute their loss on ``logits.float()``: on float64
  storage the loss is float32 again, and probes' steps of 6e-6 vanish in its rounding (every probe reads ``flat``).
* **Tensors created in the default dtype.** A causal mask built in forward (``torch.full((t, t), float("-inf"))``)
  stays float32 beside float64 queries, and a mixed-dtype kernel path computes another function.
* **Random draws in the input's dtype.** ``torch.randn(..., dtype=x.dtype)`` (GAN latents), ``torch.randn_like(mu)``
  (a VAE's reparameterisation), diffusion noise, ``fractional_max_pool``'s samples: from the same random state, float64
  draws are other numbers than float32 draws.

:class:`Float64Fidelity`, active during float64 evaluations, keeps such casts at float64 (``.float()``,
``.to(torch.float32)``, ``dtype=torch.float32``), promotes what factories create in the default dtype to float64 (and
computes an operation writing into such a float64 ``out=`` buffer in float64), and makes random draws in the model's own
dtype before casting them, the numbers training draws. When its first evaluation of a check changed nothing
(:attr:`Float64Fidelity.acted`) it is not used again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gradwatch.engine.function.modes import OperationMode
from gradwatch.engine.results.notes import Note, NoteCode

_RANDOM_FACTORIES = {torch.randn, torch.rand, torch.normal}
_RANDOM_LIKE = {torch.randn_like, torch.rand_like}
_RANDOM_IN_PLACE = {
    Tensor.normal_, Tensor.uniform_, Tensor.exponential_, Tensor.cauchy_, Tensor.log_normal_, Tensor.geometric_
}  # fmt: skip
_DOWNCASTS = {Tensor.float: torch.float32, Tensor.half: torch.float16, Tensor.bfloat16: torch.bfloat16}
_LOWER = {torch.float32, torch.float16, torch.bfloat16}


def _is_float64(value: object) -> bool:
    return isinstance(value, Tensor) and value.dtype == torch.float64


class Float64Fidelity(OperationMode):
    """Keeps a float64 evaluation of a model whose parameters train in ``native_dtype`` (random draws are made in it)
    the model's own function (see the module doc)."""

    def __init__(self, native_dtype: torch.dtype) -> None:
        super().__init__()
        self.native_dtype = native_dtype
        self.acted: set[str] = set()
        """What it changed so far: ``"casts"`` and/or ``"random draws"``."""
        self.watch: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], None] | None = None
        """Run first at every operation while set: the job of a mode that would otherwise be stacked on this one (the
        float64 trial's :meth:`OriginalsSeen.check <gradwatch.engine.function.substitution.OriginalsSeen.check>`),
        done in the same order for ~5 µs less per operation."""

    def notes(self) -> list[Note]:
        """The notes of what it changed: casts kept, random draws made natively (none for factories)."""
        native = str(self.native_dtype).removeprefix("torch.")
        kept = {
            "casts": "its casts to a lower precision were kept at float64",
            "random draws": f"its random draws were made in {native}, as training makes them, and cast",
        }
        codes = {"casts": NoteCode.FLOAT64_CASTS_KEPT, "random draws": NoteCode.FLOAT64_DRAWS_NATIVE}
        return [
            Note(codes[what], f"float64 probes evaluate the model's own function: {kept[what]}")
            for what in sorted(self.acted & set(codes))
        ]

    def operation(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.watch is not None:
            self.watch(func, args, kwargs)
        if not kwargs and func not in _HANDLED:  # most operations: nothing below applies (no dtype, no out=)
            return func(*args)
        kwargs = dict(kwargs)
        if func in _DOWNCASTS and args and _is_float64(args[0]):
            self.acted.add("casts")
            return args[0]
        if func in (Tensor.to, Tensor.type) and args and _is_float64(args[0]):
            return self._to(func, args, kwargs)
        if func in _RANDOM_FACTORIES or func in _RANDOM_LIKE or func in _RANDOM_IN_PLACE:
            drawn = self._random(func, args, kwargs)
            if drawn is not None:
                return drawn
        if _is_float64(kwargs.get("out")) and any(isinstance(a, Tensor) and a.dtype in _LOWER for a in args):
            # torch.mm(a, b, out=buffer) into a buffer a factory made float64 here: the inputs in its precision too
            self.acted.add("casts")
            args = tuple(a.to(torch.float64) if isinstance(a, Tensor) and a.dtype in _LOWER else a for a in args)
        dtype = kwargs.get("dtype")
        if dtype is None and func in _DEFAULT_DTYPE_FACTORIES:
            return self._promoted(func(*args, **kwargs))
        if dtype in _LOWER and (any(_is_float64(a) for a in args) or func in _FACTORIES):
            # softmax(x, dtype=torch.float32), x.sum(dtype=...), torch.zeros(..., dtype=torch.float32)
            self.acted.add("casts")
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)

    def _promoted(self, created: Any) -> Any:
        """A tensor a factory made in the default dtype (a causal mask built in forward), as float64."""
        if isinstance(created, Tensor) and created.dtype in _LOWER and created.dtype == torch.get_default_dtype():
            self.acted.add("factories")
            return created.to(torch.float64)
        return created

    def _to(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``x.to(torch.float32)``, ``x.to(other)``, ``x.to(device, torch.float32)``, ``x.type(torch.float32)`` kept at
        float64, their other arguments applied."""
        rest = list(args[1:])
        for i, value in enumerate(rest):
            if value in _LOWER:
                rest[i] = torch.float64
                self.acted.add("casts")
            elif isinstance(value, Tensor) and value.dtype in _LOWER and i == 0 and func is Tensor.to:
                rest[i] = value.to(torch.float64)  # x.to(other): other's dtype and device
                self.acted.add("casts")
            elif isinstance(value, str) and func is Tensor.type and value in ("torch.FloatTensor", "torch.HalfTensor"):
                rest[i] = "torch.DoubleTensor"
                self.acted.add("casts")
        if kwargs.get("dtype") in _LOWER:
            kwargs["dtype"] = torch.float64
            self.acted.add("casts")
        return func(args[0], *rest, **kwargs)

    def _random(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
        """A float64 random draw made in the native dtype and cast; ``None`` for one that is not float64."""
        native = self.native_dtype
        if func in _RANDOM_IN_PLACE:
            if not (args and _is_float64(args[0])):
                return None
            target = args[0]
            drawn = torch.empty(target.shape, dtype=native, device=target.device)
            func(drawn, *args[1:], **kwargs)
            self.acted.add("random draws")
            with torch.no_grad():
                target.copy_(drawn)
            return target
        if func in _RANDOM_LIKE:
            if not (args and _is_float64(args[0])) or kwargs.get("dtype", torch.float64) != torch.float64:
                return None
            self.acted.add("random draws")
            return func(args[0], **{**kwargs, "dtype": native}).to(torch.float64)
        if func is torch.normal:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
            if not any(_is_float64(t) for t in tensors) or kwargs.get("generator") is not None:
                return None
            mean, std = [*args, kwargs.get("mean", 0.0), kwargs.get("std", 1.0)][:2]
            shape = torch.broadcast_shapes(*(t.shape for t in tensors))
            device = tensors[0].device
            self.acted.add("random draws")
            return mean + std * torch.randn(shape, dtype=native, device=device).to(torch.float64)
        requested = kwargs.get("dtype") or torch.get_default_dtype()
        if requested != torch.float64:
            return None
        self.acted.add("random draws")
        return func(*args, **{**kwargs, "dtype": native}).to(torch.float64)


_DEFAULT_DTYPE_FACTORIES = {
    torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.linspace, torch.logspace, torch.eye,
    torch.tensor, torch.as_tensor,
}  # fmt: skip
"""Functions that, without a ``dtype``, create floating tensors in the default dtype (float32): promoted during a
float64 evaluation."""

_FACTORIES = _DEFAULT_DTYPE_FACTORIES | {torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like}
"""Functions that create a tensor of the ``dtype`` they are given: asked for float32 during a float64 evaluation, they
create float64."""

_HANDLED = frozenset(
    {*_DOWNCASTS, Tensor.to, Tensor.type, *_RANDOM_FACTORIES, *_RANDOM_LIKE, *_RANDOM_IN_PLACE, *_FACTORIES}
)
"""The functions :class:`Float64Fidelity` may change called without keyword arguments; any other passes as it is."""
