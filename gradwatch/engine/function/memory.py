"""A check's memory: what it will take, what the device has free, and what becomes of an out-of-memory error.

Training on a GPU is sized to fill the card, and a check holds more than a training step: a float64 copy of the
parameters it probes and float64 activations (4x bf16's) of its probe batch, times the points of a vectorised pass. So
a check estimates its peak (:func:`check_peak`, rough) against the device's free memory (:func:`free_memory`) and
probes natively, with a note, where float64 would not fit. An out-of-memory error inside a check anyway ends the
check, never the run: it becomes a :class:`CheckOutOfMemoryError`, which every fallback lets through, the training
state is put back, what the check allocated is freed (:func:`release_memory`) and the report is ``"inconclusive"``,
from which the next check learns to run cheaper (:func:`backed_off`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.errors import CheckOutOfMemoryError

__all__ = [
    "CheckOutOfMemoryError", "MemoryEstimate", "affordable_samples", "backed_off", "check_peak",
    "ending_check_when_out_of_memory", "free_memory", "is_out_of_memory", "learn_activations", "release_memory",
    "set_free_memory_probe", "surviving_out_of_memory",
]  # fmt: skip

HEADROOM = 0.8
"""The share of the free memory a check plans to use: the rest is left for the allocator's fragmentation and for the
estimate's roughness."""

_ALLOCATOR_MESSAGES = ("out of memory", "can't allocate memory", "defaultcpuallocator", "failed to allocate")

FreeMemoryProbe = Callable[[torch.device], "int | None"]
"""A function giving the bytes free on a device (``None``: unknown)."""

_probe: FreeMemoryProbe | None = None

_PER_SAMPLE: weakref.WeakKeyDictionary[nn.Module, float] = weakref.WeakKeyDictionary()
"""The bytes of activations per sample a reference pass of each model saved for its backward, as last measured."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says an allocation failed: ``torch.OutOfMemoryError`` (CUDA, and the accelerators that raise
    it), or a ``RuntimeError`` of an allocator (the CPU's "DefaultCPUAllocator: can't allocate memory", MPS's "out of
    memory")."""
    if isinstance(error, (torch.OutOfMemoryError, CheckOutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error).lower() for text in _ALLOCATOR_MESSAGES)


@contextlib.contextmanager
def ending_check_when_out_of_memory() -> Iterator[None]:
    """Turn an out-of-memory error raised inside into a :class:`CheckOutOfMemoryError`, which ends the check."""
    try:
        yield
    except CheckOutOfMemoryError:
        raise
    except Exception as error:
        if is_out_of_memory(error):
            raise CheckOutOfMemoryError(
                f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            ) from error
        raise


@contextlib.contextmanager
def surviving_out_of_memory(precision: str | None, device: torch.device | None) -> Iterator[list[Note]]:
    """End a check that runs out of memory inside, instead of the run: the error is caught, the list yielded gets the
    note that says so, and what the check allocated is freed. Enter it outside the context that puts the training
    state back."""
    ran_out: list[Note] = []
    try:
        yield ran_out
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        problem = str(error) if isinstance(error, CheckOutOfMemoryError) else f"{type(error).__name__}: {error}"
        probes = f" with {precision} probes" if precision else ""
        text = f"the check ran out of memory{probes} ({problem.splitlines()[0]}); the training state "
        ran_out.append(Note(NoteCode.OUT_OF_MEMORY, text + "is put back and the next check of a run is made cheaper"))
        release_memory(device, error)


def set_free_memory_probe(probe: FreeMemoryProbe | None) -> FreeMemoryProbe | None:
    """Tell gradwatch how to read the free memory of a device it cannot read itself (an accelerator without
    ``mem_get_info``, or an emulated device in a test); ``None`` removes it. Returns the probe it replaces."""
    global _probe
    if probe is not None and not callable(probe):
        raise TypeError(f"`probe` must be callable as probe(device) -> int | None; got {type(probe).__name__}")
    previous, _probe = _probe, probe
    return previous


def free_memory(device: torch.device) -> int | None:
    """The bytes free on ``device``: from the probe set with :func:`set_free_memory_probe` if any, else
    ``mem_get_info`` (on CUDA plus what PyTorch's caching allocator holds unused); ``None`` when unknown (the CPU)."""
    if _probe is not None:
        return _probe(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    module = getattr(torch, device.type, None)
    reader = getattr(module, "mem_get_info", None) if device.type != "cpu" else None
    if reader is not None:
        try:
            return int(reader(device)[0])
        except (RuntimeError, TypeError, ValueError):
            return None
    return None


def release_memory(device: torch.device | None, error: BaseException | None = None) -> None:
    """Free what a check that ran out of memory left allocated, and the caching allocator's blocks it held, for
    training's next step. The frames of ``error``'s traceback (and of the errors it was raised from) are cleared first:
    they hold the check's tensors."""
    while error is not None:
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    gc.collect()
    if (device is None or device.type == "cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """A check's estimated peak beyond what training holds, in bytes: ``float64`` (float64 copies of the parameters,
    buffers and inputs, and the activations autograd saved in the reference at 8 bytes each), ``native`` (those
    activations in the parameters' dtype and a displaced copy of the largest tensor), and the bytes ``free`` on the
    device (``None``: unknown)."""

    float64: int
    native: int
    free: int | None

    def fits(self, precision: str) -> bool:
        """Whether the probes in ``precision`` fit within :data:`HEADROOM` of the free memory (unknown: they do)."""
        need = self.float64 if precision == "float64" else self.native
        return self.free is None or need <= HEADROOM * self.free

    def describe(self, precision: str) -> str:
        """The estimate in words, for a note."""
        need = self.float64 if precision == "float64" else self.native
        free = "unknown" if self.free is None else _mib(self.free)
        return f"{precision} probes need about {_mib(need)} (an estimate), {free} free on the device"


def check_peak(params: Sequence[Tensor], buffers: Sequence[Tensor], inputs: Sequence[Tensor], saved_elements: int,
               native_itemsize: int, device: torch.device) -> MemoryEstimate:  # fmt: skip
    """The estimate of a check's peak (:class:`MemoryEstimate`): the copies of what it probes and the activations of
    its probe batch (the gradients and the training state it keeps are training's)."""
    copies = 8 * sum(t.numel() for t in [*params, *buffers, *inputs] if t.is_floating_point())
    activations = 8 * saved_elements
    largest = max((t.numel() for t in params), default=0)
    native = saved_elements * native_itemsize + 2 * largest * native_itemsize
    return MemoryEstimate(float64=copies + activations, native=native, free=free_memory(device))


def backed_off(
    precision: str, *, float64_reductions: bool, vectorize: bool, probe_batch_size: int | None, samples: int | None
) -> dict[str, Any]:
    """The settings of the check after one that ran out of memory, one step cheaper: native probes, else native
    reductions, else no vectorised passes, else half the probe batch (``{}``: nothing left to give up)."""
    if precision == "float64":
        return {"precision": "native"}
    if float64_reductions:
        return {"float64_reductions": False}
    if vectorize:
        return {"vectorize": False}
    current = probe_batch_size if probe_batch_size is not None else samples
    if current is not None and current > 1:
        return {"probe_batch_size": max(1, current // 2)}
    return {}


def learn_activations(model: nn.Module, saved_bytes: int, samples: int | None) -> None:
    """Remember the bytes a reference pass of ``model`` on ``samples`` samples saved for its backward
    (:func:`affordable_samples`)."""
    if samples:
        _PER_SAMPLE[model] = saved_bytes / samples


def affordable_samples(model: nn.Module, params: Sequence[Tensor], wanted: int, fewest: int) -> tuple[int, str]:
    """The most samples, up to ``wanted``, a check of ``model`` can evaluate at once within :data:`HEADROOM` of the
    device's free memory, and why fewer (``""``: all of them fit, or the free memory is unknown).

    A check holds a copy of the parameters it probes and their reference gradient besides the activations of its
    evaluation, estimated per sample from the model's last reference pass. 0 when fewer than ``fewest`` fit (the check
    is postponed): 1 for a recomputed check, the whole window for an applied one."""
    per_sample = _PER_SAMPLE.get(model, 0.0)  # unknown before the model's first reference: the copies alone
    device = next((p.device for p in params), None)
    free = free_memory(device) if device is not None else None
    if free is None or wanted <= 0:
        return wanted, ""
    fixed = 2 * sum(p.numel() * p.element_size() for p in params)
    fits = max(math.floor((HEADROOM * free - fixed) / max(per_sample, 1.0)), 0)
    if fits >= wanted:
        return wanted, ""
    fits = 0 if fits < fewest else fits
    need = fixed + per_sample * (wanted if fits == 0 else fits)
    return fits, f"{_mib(int(need))} estimated for {wanted if fits == 0 else fits} sample(s), {_mib(free)} free"


def _mib(size: int) -> str:
    """``size`` bytes in the unit that shows them (KiB, MiB or GiB)."""
    unit = next((u for u in (3, 2) if size >= 2 ** (10 * u)), 1)
    return f"{size / 2 ** (10 * unit):.1f} {('KiB', 'MiB', 'GiB')[unit - 1]}"
