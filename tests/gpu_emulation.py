"""A GPU's behaviour imitated on the CPU, so that what gradwatch does there is tested where CI runs.

* **Memory**: :class:`Float64MemoryLimit` raises ``torch.OutOfMemoryError`` for every float64 tensor above a size, or
  at the k-th float64 allocation (an out-of-memory error injected at one phase of a check);
  :class:`LimitedDevice` tracks the bytes of the tensors alive and raises past a limit, and tells gradwatch what is
  free (``set_free_memory_probe``), as ``torch.cuda.mem_get_info`` would.
* **Float64's price**: :class:`SlowFloat64` makes a float64 forward cost ``factor`` native ones.
* **TF32**: :class:`TF32Emulation` rounds the float32 operands of matmuls and convolutions to TF32's 10-bit mantissa
  wherever the backend settings let a GPU use TF32 (``torch.backends.cuda.matmul`` / ``cudnn.conv``
  ``fp32_precision == "tf32"``), and only there, as the kernels do.
* **Kernels**: :class:`ShuffledLinear` sums its weight gradient in a random order at every backward (atomics);
  :class:`RefusesFloat64` raises on float64, :class:`Float32Inside` accepts it and computes in float32
  (:class:`OpaqueFloat32Inside` out of gradwatch's sight, as a Triton kernel does); each can carry a backward wrong by
  a factor; :class:`Bf16OnlyRMSNorm` accepts bfloat16 only (pure-bf16 training).
"""

from __future__ import annotations

import copy
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import gradwatch.engine.function.memory as memory


def _tensors(value: Any) -> list[Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, Tensor)]


class Float64MemoryLimit(TorchDispatchMode):
    """Raise ``torch.OutOfMemoryError`` for each float64 tensor an operation makes above ``above`` elements, or at the
    ``at``-th float64 tensor made (counted from 1; ``None``: every one above the size). ``made`` counts them,
    ``largest`` is the most elements of one."""

    def __init__(self, above: int = 0, at: int | None = None) -> None:
        super().__init__()
        self.above, self.at = above, at
        self.made = 0
        self.raised = 0
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in _tensors(out):
            if tensor.dtype == torch.float64:
                self.made += 1
                self.largest = max(self.largest, tensor.numel())
                if (self.at is None and tensor.numel() > self.above) or self.made == self.at:
                    self.raised += 1
                    raise torch.OutOfMemoryError(
                        f"CUDA out of memory (emulated): {tensor.numel()} float64 elements by {func}"
                    )
        return out


class LimitedDevice(TorchDispatchMode):
    """A device with ``limit`` bytes for the tensors made under it: those alive are counted (by storage), an operation
    that would pass the limit raises ``torch.OutOfMemoryError``, and gradwatch reads ``limit - alive`` as free memory.
    ``peak`` is the most alive at once. With ``limit=None`` it only measures (a training step's peak)."""

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.alive = 0
        self.peak = 0
        self._storages: dict[int, list[int]] = {}  # data pointer -> [bytes, tensors alive on it]
        self._previous: memory.FreeMemoryProbe | None = None

    def free(self, device: torch.device) -> int | None:
        return None if self.limit is None else max(self.limit - self.alive, 0)

    def __enter__(self) -> LimitedDevice:
        self._previous = memory.set_free_memory_probe(self.free)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        memory.set_free_memory_probe(self._previous)
        super().__exit__(*exc)

    def _released(self, pointer: int) -> None:
        entry = self._storages.get(pointer)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.alive -= entry[0]
            del self._storages[pointer]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        new = {}
        given = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}  # in place, a view: not made here
        for tensor in _tensors(out):
            pointer = tensor.untyped_storage().data_ptr()
            if pointer and pointer not in self._storages and pointer not in given:
                new[pointer] = tensor.untyped_storage().nbytes()
        if self.limit is not None and self.alive + sum(new.values()) > self.limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (emulated): tried to allocate {sum(new.values())} bytes, "
                f"{self.limit - self.alive} free"
            )
        for tensor in _tensors(out):
            pointer = tensor.untyped_storage().data_ptr()
            if not pointer:
                continue
            if pointer in new:
                self._storages[pointer] = [new.pop(pointer), 0]
                self.alive += self._storages[pointer][0]
            if pointer in self._storages:
                self._storages[pointer][1] += 1
                weakref.finalize(tensor, self._released, pointer)
        self.peak = max(self.peak, self.alive)
        return out


class SlowFloat64(TorchDispatchMode):
    """Every operation computing in float64 (float64 operands and result) waits ``wait`` seconds besides the time it
    ran: :meth:`calibrated` sets it so that a float64 forward of a model costs ``factor`` native ones, as on a GPU
    without float64 units (a tiny model on a CPU spends its forward in Python, not in kernels, so a factor on each
    kernel's own time would not make float64 dear). ``waited`` is the total waited."""

    def __init__(self, wait: float) -> None:
        super().__init__()
        self.wait = wait
        self.waited = 0.0

    @classmethod
    def calibrated(cls, model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Tensor],
                   factor: float = 100.0) -> SlowFloat64:  # fmt: skip
        """Float64 forwards ``factor`` times dearer than native ones of ``loss_fn(model, batch)`` as a check evaluates
        them (a native check's time per forward pass, the fastest of 3: on a tiny model gradwatch's own Python work
        per evaluation outweighs the kernels, so the price is set against that, as a device's would be). Calibrate it
        under the modes the checks will run under (a :class:`LimitedDevice`'s bookkeeping slows every pass): priced
        without them, float64 comes out only a few native steps dear there, and the clock decides."""
        from gradwatch import check_gradients

        per_forward = []
        for _ in range(3):
            report = check_gradients(model, batch, loss_fn, precision="native", probe_batch_size=4)
            per_forward.append(report.duration_s / max(report.n_forward, 1))
        double = copy.deepcopy(model).double()
        promoted = tree_map(lambda t: t.double() if isinstance(t, Tensor) and t.is_floating_point() else t, batch)
        with _CountFloat64() as counting, torch.no_grad():
            loss_fn(double, promoted)
        return cls(factor * min(per_forward) / max(counting.ops, 1))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        computes = any(t.dtype == torch.float64 for t in _tensors((args, kwargs)))  # not a cast to float64
        if computes and any(t.dtype == torch.float64 for t in _tensors(out)):
            self.waited += self.wait
            time.sleep(self.wait)
        return out


class _CountFloat64(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += any(t.dtype == torch.float64 for t in _tensors((args, kwargs)))
        return out


def tf32(tensor: Tensor) -> Tensor:
    """``tensor`` (float32) rounded to TF32: 10 explicit mantissa bits, round to nearest even."""
    bits = tensor.contiguous().view(torch.int32)
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return rounded.view(torch.float32)


_MATMULS = {torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.nn.functional.linear, Tensor.matmul, Tensor.mm,
            Tensor.__matmul__, torch.einsum, torch.baddbmm}  # fmt: skip
_CONVOLUTIONS = {torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d, torch.conv2d}


def _setting(backend: Any, legacy: str) -> bool:
    precision = getattr(backend, "fp32_precision", None)
    return precision == "tf32" if precision is not None else bool(getattr(backend, legacy, False))


class TF32Emulation(TorchFunctionMode):
    """Round the float32 operands of matmuls (where ``torch.backends.cuda.matmul`` allows TF32) and convolutions
    (where ``torch.backends.cudnn.conv`` does) to TF32 before they run, forward and, through autograd, backward (the
    rounding is applied to the operands the backward saves too). ``rounded`` counts the operations rounded."""

    def __init__(self, matmul: bool = True, conv: bool = True) -> None:
        super().__init__()
        self.matmul, self.conv = matmul, conv
        self.rounded = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> TF32Emulation:
        for backend, on in ((torch.backends.cuda.matmul, self.matmul), (torch.backends.cudnn.conv, self.conv)):
            if on:
                self._saved.append((backend, "fp32_precision", backend.fp32_precision))
                backend.fp32_precision = "tf32"
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for backend, name, value in reversed(self._saved):
            setattr(backend, name, value)
        self._saved.clear()
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        applies = (func in _MATMULS and _setting(torch.backends.cuda.matmul, "allow_tf32")) or (
            func in _CONVOLUTIONS and _setting(torch.backends.cudnn.conv, "allow_tf32")
        )
        if applies:
            rounded = [_TF32Round.apply(a) if _is_float32(a) else a for a in args]
            if any(r is not a for r, a in zip(rounded, args, strict=True)):
                self.rounded += 1
                args = tuple(rounded)
        return func(*args, **kwargs)


def _is_float32(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dtype == torch.float32


class _TF32Round(torch.autograd.Function):
    """TF32 rounding as the kernel does it: the operands rounded, the gradient passed through (and rounded where it is
    an operand of the backward's own matmul, as on a GPU)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        return tf32(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return tf32(grad) if grad.dtype == torch.float32 else grad


class _ShuffledMatmul(torch.autograd.Function):
    """``x @ weight.T`` whose weight gradient sums the samples' outer products with ``index_add_`` in a random order
    drawn at every backward from the global generator's entropy-free counter (not the replayed random state): two
    backward passes of the same point differ in their rounding, as atomics do on a GPU."""

    counter = 0

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, factor: float) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.factor = factor
        return x @ weight.T

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight = ctx.saved_tensors
        _ShuffledMatmul.counter += 1
        order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(_ShuffledMatmul.counter))
        products = grad[order].unsqueeze(2) * x[order].unsqueeze(1)  # samples x out x in
        total = torch.zeros((1, *weight.shape), dtype=weight.dtype)
        for sample in range(x.shape[0]):  # one by one, in the shuffled order: a different rounding at every call
            total.index_add_(0, torch.zeros(1, dtype=torch.long), products[sample : sample + 1])
        return grad @ weight, total[0] * ctx.factor, None


class ShuffledLinear(nn.Linear):
    """A linear layer (2-D input) whose weight gradient is summed in a random order at every backward; ``factor``
    scales that gradient (1: correct)."""

    def __init__(self, *args: Any, factor: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return _ShuffledMatmul.apply(x, self.weight, self.factor) + self.bias


class _ScaledTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float, compute: Callable[[Tensor], Tensor]) -> Tensor:
        y = compute(x)
        ctx.save_for_backward(y)
        ctx.factor = factor
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y) * ctx.factor, None, None


class RefusesFloat64(nn.Module):
    """A fused activation kernel (tanh) that refuses float64 as flash attention and Triton kernels do; ``factor``
    scales its backward (1: correct)."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float64:
            raise RuntimeError("fused_tanh: expected scalar type Float, BFloat16 or Half but found Double")
        return _ScaledTanh.apply(x, self.factor, torch.tanh)


class Float32Inside(nn.Module):
    """A fused activation kernel (tanh) that accepts float64 and computes in float32 (FlagGems#2310); ``factor``
    scales its backward (1: correct)."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return _ScaledTanh.apply(x, self.factor, lambda t: torch.tanh(t.float()).to(t.dtype))


def _float32_unseen(tensor: Tensor) -> Tensor:
    with torch._C.DisableTorchFunction():  # a Triton kernel's cast: no TorchFunctionMode sees it
        return torch.tanh(tensor.float()).to(tensor.dtype)


class OpaqueFloat32Inside(Float32Inside):
    """:class:`Float32Inside` whose float32 computation no ``TorchFunctionMode`` sees, as a Triton kernel's (gradwatch's
    float64 fidelity keeps ``.float()`` at float64 where it sees it)."""

    def forward(self, x: Tensor) -> Tensor:
        return _ScaledTanh.apply(x, self.factor, _float32_unseen)


class Bf16RMSNormKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, factor: float) -> Tensor:
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
            raise RuntimeError(f"fused_rms_norm: expected BFloat16 but found {x.dtype} and {weight.dtype}")
        ctx.save_for_backward(x, weight)
        ctx.factor = factor
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * weight.float()).to(torch.bfloat16)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight = ctx.saved_tensors
        xf, gf = x.float(), grad.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        normed = xf * rstd
        gn = gf * weight.float()
        grad_x = rstd * (gn - normed * (gn * normed).mean(-1, keepdim=True)) * ctx.factor
        return grad_x.to(torch.bfloat16), (gf * normed).reshape(-1, x.shape[-1]).sum(0).to(torch.bfloat16), None


class Bf16OnlyRMSNorm(nn.Module):
    """A fused RMSNorm kernel that accepts bfloat16 only (raises on float32 and float64, as Liger's and Transformer
    Engine's bf16 kernels do), float32 inside; ``factor`` scales its input gradient (1: correct)."""

    def __init__(self, width: int, factor: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return Bf16RMSNormKernel.apply(x, self.weight, self.factor)
