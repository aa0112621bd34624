"""The precision probes evaluate the loss in: the model's own dtype, or float64.

Finite differences lose about half the digits of the dtype they are computed in: ~1e-5 left in float32, ~1e-2 at best
for a 16-bit model, far from a 1% error. Float64 removes the numerical noise almost entirely, at the price of float64
kernels (about 2x slower on CPUs and data-centre GPUs, far slower on consumer GPUs, missing for a few operations) and a
float64 copy of the parameters and buffers during the check.

``precision="auto"`` probes in float64 every model that is not float64 already, as long as the float64 copy of its
parameters stays small (:data:`AUTO_FLOAT64_ELEMENTS`), fits in the device's free memory
(:mod:`~gradwatch.engine.function.memory`) and float64 is not priced out on the device (:data:`FLOAT64_SLOWDOWN_LIMIT`).
Native float32 probes cannot tell a 1e-3 error from noise on a network full of kinks (ReLU, max-pool): their steps
must be large to beat round-off, and large steps cross kinks. In float64 the steps are thousands of times smaller and
round-off still negligible, so a healthy check ends after its screens instead of escalating: on a CPU float64 probes
cost no more than float32 ones. Larger models are probed natively, the few probes whose native stencils could not
decide measured again in float64.

The analytic gradient is never the float64 version's: it is the one training uses, in the model's own dtype, with its
hooks.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from types import TracebackType
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from gradwatch.engine.distributed import tensor_parallel
from gradwatch.engine.distributed.collective import any_rank
from gradwatch.engine.function.complex_params import autograd_tensor, checked_view, is_real_view
from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.function.memory import check_peak, is_out_of_memory, release_memory
from gradwatch.engine.function.modes import OperationMode
from gradwatch.engine.function.substitution import OriginalsSeen, substituted
from gradwatch.engine.function.values import first_line
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import CheckAbandonedError
from gradwatch.errors import own_error

Precision = Literal["auto", "native", "float64"]
"""``"native"``: probes evaluate the loss in the parameters' own dtype. ``"float64"``: in float64, on float64 copies
of the parameters, buffers and floating inputs. ``"auto"``: float64 up to :data:`AUTO_FLOAT64_ELEMENTS` floating
parameter elements; native beyond, with undecided probes measured again in float64."""

ResolvedPrecision = Literal["native", "float64"]
"""What a check's probes evaluate the loss in, once ``"auto"`` is resolved."""

PRECISIONS: tuple[Precision, ...] = ("auto", "native", "float64")

_PROMOTED = {
    **dict.fromkeys((torch.float16, torch.bfloat16, torch.float32, torch.float64), torch.float64),
    **dict.fromkeys((torch.complex32, torch.complex64, torch.complex128), torch.complex128),
}
"""The dtype a float64 evaluation gives a parameter, buffer or input of each dtype: complex ones become complex128."""

AUTO_FLOAT64_ELEMENTS = 2**25
"""The most floating parameter elements ``precision="auto"`` probes in float64 (about 33M: a 256 MiB float64 copy)."""


def resolve_precision(precision: Precision, parameter_dtype: torch.dtype, parameter_elements: int) -> ResolvedPrecision:
    """What ``precision`` means for a model of ``parameter_elements`` floating parameter elements, the least precise in
    ``parameter_dtype``."""
    if parameter_dtype == torch.float64:
        return "native"
    if precision == "auto":
        return "float64" if parameter_elements <= AUTO_FLOAT64_ELEMENTS else "native"
    return precision


@contextlib.contextmanager
def float64_storage(model: nn.Module, moved: Collection[int] | None = None) -> Iterator[dict[int, Tensor]]:
    """Evaluate ``model`` on float64 copies of its floating parameters and buffers, then put everything back; yields
    the float64 substitute of each parameter, by ``id(parameter)``: probes perturb those.

    Parameters are substituted, not converted: the ``Parameter`` objects, their ``.grad``, hooks and the gradient
    accumulators DDP and optimizers hook into are never touched (changing a parameter's dtype in place would reset its
    accumulator and silently unhook DDP's gradient reduction). Buffers get float64 storage and their own back after.
    With ``moved`` (the ``id`` of the parameters probes will move), only those get a substitute; the others are cast
    where an operation uses them (:class:`CastOnUse`). Gradient-free
    evaluations only.
    """
    by_identity: dict[int, Tensor] = {}
    cast: dict[int, torch.dtype] = {}
    for parameter in model.parameters():
        if parameter.dtype in _PROMOTED and parameter.dtype not in (torch.float64, torch.complex128):
            if moved is not None and id(parameter) not in moved:
                cast[id(parameter)] = _PROMOTED[parameter.dtype]
                continue
            by_identity[id(parameter)] = parameter.detach().to(_PROMOTED[parameter.dtype])
            _SOURCES[by_identity[id(parameter)]] = parameter
    saved: list[tuple[Tensor, Tensor]] = []
    try:
        with torch.no_grad():
            for buffer in model.buffers():
                if buffer.dtype in _PROMOTED and buffer.dtype not in (torch.float64, torch.complex128):
                    saved.append((buffer, buffer.data))
                    buffer.data = buffer.data.to(_PROMOTED[buffer.dtype])
        with substituted(model, by_identity), CastOnUse(cast) if cast else contextlib.nullcontext():
            yield by_identity
    finally:
        for buffer, original in reversed(saved):
            buffer.data = original


class CastOnUse(OperationMode):
    """Casts the tensors of ``cast`` (by ``id``: the dtype each is read in, float64 or complex128) wherever an operation
    receives them: float64 evaluation of a large model without a float64 copy of it.

    A float64 substitute for every parameter (:func:`float64_storage`) doubles the float32 parameters held, which beyond
    the float64 limit a check must not add to a training step's memory. A float64 re-measurement of a few undecided
    probes moves only their tensors; the others need only *read* as float64, cast while the operation runs
    (gradient-free evaluations keep nothing for a backward). An attribute read that returns the parameter's values
    (``.T``, ``.mT``, ``.data``) is cast too; ``.shape``, ``.dtype`` and the like pass through.
    """

    def __init__(self, cast: Mapping[int, torch.dtype]) -> None:
        super().__init__()
        self._cast = cast

    def _converted(self, value: Any) -> Any:
        if isinstance(value, Tensor) and id(value) in self._cast:
            return value.detach().to(self._cast[id(value)])
        return value

    def operation(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if getattr(func, "__name__", "") == "__get__":  # an attribute: cast only what holds the tensor's values
            result = func(*args, **kwargs)
            owner = args[0] if args else None
            if (
                isinstance(result, Tensor)
                and isinstance(owner, Tensor)
                and id(owner) in self._cast
                and result.dtype == owner.dtype
                and result.untyped_storage().data_ptr() == owner.untyped_storage().data_ptr()
            ):
                return result.detach().to(self._cast[id(owner)])
            return result
        args, kwargs = tree_map(self._converted, (args, kwargs))
        return func(*args, **kwargs)


_SOURCES: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""The parameter each float64 substitute was copied from, while the substitute lives."""


def exact_source(tensor: Tensor) -> Tensor | None:
    """The parameter a float64 substitute was copied from (unmoved meanwhile), from which a probe restores the
    substitute instead of keeping a float64 copy; ``None`` for any other tensor."""
    source = _SOURCES.get(tensor)
    return source if source is not None and source.shape == tensor.shape else None


def substitute_of(checked: Tensor, substitutes: dict[int, Tensor]) -> Tensor:
    """The float64 tensor a check perturbs in place of ``checked`` (a parameter, or a complex one's real view)."""
    found = substitutes.get(id(autograd_tensor(checked)))
    if found is None:
        return checked
    return checked_view(found) if is_real_view(checked) else found


FLOAT64_SLOWDOWN_LIMIT = 10.0
"""The most a float64 evaluation of the loss (a forward pass) may cost against the check's native reference pass (a
forward and a backward: a training step's work), timed on the device, before ``precision="auto"`` probes natively,
with float64 only for the probes native ones leave undecided, and a note. By peak-rate arithmetic a float64 forward of
a GEMM-bound model costs under one step on a CPU, ~5 steps on an H100 or A100 (float64 tensor cores: float64 stays),
~19 on a B200, ~43 on an RTX 4090 and 600-900 on a B300 (native)."""


@contextlib.contextmanager
def probe_precision(
    model: nn.Module, evaluator: LossEvaluator, mode: str, *, step_seconds: float = math.nan
) -> Iterator[tuple[str, float]]:
    """Evaluate the probes on float64 storage if ``mode`` asks for it; yields the precision used and the loss of the
    trial evaluation in float64 (NaN if none), the probes' centre.

    Falls back to the native precision, with a note, when the loss does not run in float64, when float64 would not fit
    in the device's free memory (estimated, or an out-of-memory error in the copy or the trial) and, given
    ``step_seconds`` (``precision="auto"``: the time of the native reference pass), when the trial costs more than
    :data:`FLOAT64_SLOWDOWN_LIMIT` of those. The evaluator is back on the native parameters and inputs afterwards.
    """
    if mode != "float64":
        yield "native", math.nan
        return
    native_params = evaluator.params
    code, problem = NoteCode.MEMORY_NATIVE, float64_unaffordable(model, evaluator)
    device, priced = _device_of(model), math.isfinite(step_seconds)
    if priced and not problem and _TOO_SLOW.get(model, ("", ""))[0] == str(device):  # once per model and device
        code, problem = NoteCode.FLOAT64_TOO_SLOW, _TOO_SLOW[model][1]
    if _on_any_rank(bool(problem)) and not problem:  # ranks in lockstep evaluate alike: none makes the trial
        code, problem = NoteCode.MEMORY_NATIVE, "another rank of the check cannot afford float64"
    if not problem:
        named = {id(p): name for name, p in model.named_parameters()}
        with contextlib.ExitStack() as storage:
            try:
                substitutes = storage.enter_context(float64_storage(model))
                evaluator.params = [(name, substitute_of(p, substitutes)) for name, p in native_params]
                evaluator.use_float64_inputs()
                originals = {key: name for key, name in named.items() if key in substitutes}
                evaluator.watch = OriginalsSeen(originals)  # the trial alone: a loss using an original does every time
                try:
                    trial, seconds = _timed(evaluator.loss)
                finally:
                    evaluator.watch = None
                if _on_any_rank(priced and seconds > FLOAT64_SLOWDOWN_LIMIT * step_seconds):  # again, warmed up
                    seconds = min(seconds, _timed(evaluator.loss)[1])
            except Exception as error:
                if own_error(error):  # a bug of gradwatch's own is not the loss refusing
                    raise
                if not is_out_of_memory(error) and isinstance(error, CheckAbandonedError):
                    raise
                evaluator.refused_by = None if is_out_of_memory(error) else refusing_module(model, error)
                code, problem = (
                    (NoteCode.MEMORY_NATIVE, f"float64 ran out of memory ({first_line(error)})")
                    if is_out_of_memory(error)
                    else (NoteCode.NATIVE_PRECISION, f"the loss raised {type(error).__name__} in float64 ({error})")
                )
            else:
                if _on_any_rank(priced and seconds > FLOAT64_SLOWDOWN_LIMIT * step_seconds):
                    code = NoteCode.FLOAT64_TOO_SLOW
                    problem = (
                        f"a float64 evaluation of the loss took {seconds / step_seconds:.0f}x a native forward and "
                        f"backward on this device (more than {FLOAT64_SLOWDOWN_LIMIT:.0f}x)"
                    )
                    _TOO_SLOW[model] = (str(device), problem)
                else:
                    try:
                        yield "float64", trial
                    finally:
                        evaluator.use_native_inputs()
                        evaluator.params = native_params
                    return
            finally:
                evaluator.params = native_params
    if code == NoteCode.MEMORY_NATIVE:
        release_memory(device)
    evaluator.notes.append(Note(code, f"probes run in the native precision: {problem}"))
    evaluator.use_native_inputs()
    yield "native", math.nan


def refusing_module(model: nn.Module, error: BaseException) -> type[nn.Module] | None:
    """The class of the innermost module of ``model`` whose forward ``error`` was raised in (its traceback), or
    ``None``."""
    owners = {id(m) for m in model.modules()}
    found: type[nn.Module] | None = None
    frames: TracebackType | None = error.__traceback__
    while frames is not None:
        owner = frames.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in owners and owner is not model:
            found = type(owner)
        frames = frames.tb_next
    return found


def _on_any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank the check runs in lockstep with (a sharded check's, a tensor-parallel
    model's mesh): a decision on a rank's own timing or free memory must be the same on every rank, or their
    collectives no longer match."""
    return tensor_parallel.any_replica(any_rank([flag])[0])


_TOO_SLOW: weakref.WeakKeyDictionary[nn.Module, tuple[str, str]] = weakref.WeakKeyDictionary()
"""The models whose float64 evaluation was timed too slow, with the device and what was measured: not timed again."""


def float64_unaffordable(model: nn.Module, evaluator: LossEvaluator) -> str:
    """Why float64 probes would not fit in the device's free memory (``""``: they would)."""
    params = [p for _, p in evaluator.params]
    if not params:
        return ""
    estimate = check_peak(
        params, list(model.buffers()), list(evaluator.inputs.values()), evaluator.saved_elements,
        params[0].element_size(), params[0].device,
    )  # fmt: skip
    return "" if estimate.fits("float64") else estimate.describe("float64")


def _timed(evaluate: Callable[[], float]) -> tuple[float, float]:
    """``evaluate()`` and the seconds it took, its kernels included."""
    _synchronize()
    started = time.perf_counter()
    value = evaluate()
    _synchronize()
    return value, max(time.perf_counter() - started, 1e-9)


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _device_of(model: nn.Module) -> torch.device | None:
    return next((p.device for p in model.parameters()), None)
