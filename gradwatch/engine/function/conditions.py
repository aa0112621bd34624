"""The conditions every evaluation of a check runs under: outside autocast, with full-precision float32 kernels.

The loss must be computed the same way at every point, in the weights' own dtype: autocast would round it to 16 bits
and TF32 matmuls to 10-bit mantissas, far coarser than any step a probe takes. Autocast stays off even where the loss
turns it on itself (Accelerate, so Hugging Face's ``Trainer`` and TRL's, wraps the model's ``forward`` in it under
mixed precision).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch import Tensor

from gradwatch.engine.function.torch_warnings import torch_registries_cleared

# torch >= 2.9 configures float32 matmul/conv precision per backend; older versions only have the TF32 switches.
_PRECISION_SETTINGS = (
    ("cuda", "matmul"), ("cudnn", "conv"), ("cudnn", "rnn"), ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn")
)  # fmt: skip


@contextlib.contextmanager
def full_float32_precision() -> Iterator[None]:
    """Run float32 matmuls and convolutions in full IEEE precision (no TF32, no bfloat16 shortcuts), then restore
    exactly the settings found."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for backend_name, op_name in _PRECISION_SETTINGS:
            backend = getattr(torch.backends, backend_name, None)
            settings = getattr(backend, op_name, None)
            if settings is not None and hasattr(settings, "fp32_precision"):
                saved.append((settings, "fp32_precision", settings.fp32_precision))
                settings.fp32_precision = "ieee"
        if not saved:
            legacy: tuple[Any, ...] = (torch.backends.cuda.matmul, torch.backends.cudnn)
            for settings in legacy:
                saved.append((settings, "allow_tf32", settings.allow_tf32))
                settings.allow_tf32 = False
        yield
    finally:
        for settings, name, value in reversed(saved):
            setattr(settings, name, value)


@contextlib.contextmanager
def autocast_disabled() -> Iterator[None]:
    """Leave any surrounding autocast region: probes run in the weights' own dtype."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            stack.enter_context(torch.autocast("cuda", enabled=False))
        yield


@contextlib.contextmanager
def autocast_held_off() -> Iterator[list[tuple[str, torch.dtype]]]:
    """Leave any surrounding autocast region and keep every ``torch.autocast`` entered meanwhile off (a ``forward``
    wrapped in autocast, an ``accelerator.autocast()`` in the loss); yields the regions the code tried to enable, as
    ``(device type, dtype)``: what the training's path runs under without anyone saying so.

    ``torch.autocast.__enter__`` is swapped on the class (its CUDA and CPU subclasses call it): each region is entered
    disabled and left as torch leaves any. The instance's own setting is untouched (Accelerate keeps one instance for
    every call of the forward). Other threads entering autocast during a check get it disabled too.
    """
    autocast = torch.amp.autocast_mode.autocast
    enter = autocast.__enter__
    entered: list[tuple[str, torch.dtype]] = []

    def enter_disabled(self: torch.amp.autocast_mode.autocast) -> Any:
        enabled = self._enabled
        if enabled and len(entered) < 64:  # one of each is enough; a long loss enters a region per layer
            region = (str(self.device), self.fast_dtype)
            if region not in entered:
                entered.append(region)
        self._enabled = False
        try:
            return enter(self)
        finally:
            self._enabled = enabled

    autocast.__enter__ = enter_disabled  # type: ignore[method-assign]
    try:
        with autocast_disabled():
            yield entered
    finally:
        autocast.__enter__ = enter  # type: ignore[method-assign]


class _ReentrantAsNonReentrant:
    """Stands for ``torch.utils.checkpoint.CheckpointFunction`` during a check (see
    :func:`reentrant_checkpoints_run_non_reentrant`)."""

    @staticmethod
    def apply(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        return checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)


@contextlib.contextmanager
def reentrant_checkpoints_run_non_reentrant() -> Iterator[None]:
    """Run the loss's reentrant activation checkpoints (``use_reentrant=True``, as Hugging Face may) non-reentrant.

    A reentrant checkpoint refuses ``torch.autograd.grad`` ("incompatible with .grad()"), which a check needs to leave
    ``.grad`` and the accumulation hooks alone. Both variants compute the same function and, by torch's contract, the
    same gradient. ``CheckpointFunction`` is swapped in its module, where ``checkpoint`` looks it up at each call.
    """
    original = checkpoint.CheckpointFunction
    checkpoint.CheckpointFunction = _ReentrantAsNonReentrant  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        checkpoint.CheckpointFunction = original  # type: ignore[misc]


@contextlib.contextmanager
def compiler_disabled() -> Iterator[None]:
    """Run code compiled with ``torch.compile`` eagerly (``torch.compiler.set_stance("force_eager")``, torch >= 2.6).

    A check evaluates the loss on other shapes, dtypes, grad modes and under ``vmap``: through the training's compiled
    code each would compile a new graph, and a new shape can turn the training's graph into a dynamic-shape one that
    computes slightly different numbers. Nothing to do in a process that never imported ``torch._dynamo``: nothing is
    compiled there, and ``set_stance`` would import it (3.7 s on this CPU, 30 times an applied check of a small CNN).
    """
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None or "torch._dynamo" not in sys.modules:
        yield
        return
    with set_stance("force_eager"):
        yield


@contextlib.contextmanager
def warnings_withheld() -> Iterator[list[str]]:
    """Keep the warnings raised during a check from being shown; yields the list their messages are collected in.

    The loss runs dozens of times in a check, in float64 and under ``vmap``, which warn of things training never does
    (functorch's "no batching rule"). Only ``warnings.showwarning`` is swapped: changing the filters would reset the
    ``once`` registries of the user's modules, and training would show its warnings again.
    """
    withheld: list[str] = []
    shown = warnings.showwarning

    def withhold(message: Warning | str, category: type[Warning], *args: object, **kwargs: object) -> None:
        withheld.append(f"{category.__name__}: {message}")

    # PyTorch's own warnings that training has shown once are raised again (its warning registries emptied and put
    # back): some say a gradient is silently incorrect (:mod:`.torch_warnings`)
    with torch_registries_cleared(warned=lambda: bool(withheld)):
        warnings.showwarning = withhold  # type: ignore[assignment]
        try:
            yield withheld
        finally:
            warnings.showwarning = shown


_DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")


@contextlib.contextmanager
def dropout_on_contiguous_inputs() -> Iterator[None]:
    """Let the dropout functions of ``torch.nn.functional`` draw their masks in the order of their input's elements,
    not of its memory, for the duration.

    Dropout fills its mask in memory order: on a transposed input (``nn.MultiheadAttention``'s output with
    ``batch_first=True``) an evaluation on its own and a vectorised pass, whose batched tensors lie otherwise in memory,
    would draw the same numbers into different elements. The functions are swapped in ``torch.nn.functional``, where
    ``nn.Dropout`` and the attention code look them up at every call; an input already contiguous is passed as it is
    (``inplace=True`` keeps its meaning there).
    """
    saved = {name: getattr(F, name) for name in _DROPOUTS}

    def contiguous(function: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def dropout(input: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            return function(input.contiguous(), *args, **kwargs)

        return dropout

    for name, function in saved.items():
        setattr(F, name, contiguous(function))
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(F, name, function)


@contextlib.contextmanager
def probe_conditions() -> Iterator[None]:
    """The conditions every evaluation of a check runs under: outside autocast (also where the loss enters it), with
    full-precision float32 kernels, with compiled code run eagerly, dropout drawing in element order, activation
    checkpoints non-reentrant."""
    with (
        autocast_held_off(),
        full_float32_precision(),
        compiler_disabled(),
        dropout_on_contiguous_inputs(),
        reentrant_checkpoints_run_non_reentrant(),
    ):
        yield
