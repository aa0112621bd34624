"""The settings that change the numbers a check compares: :class:`Numerics`, recorded on every report.

On a GPU the same model computes different numbers under different global settings: float32 matmuls and convolutions
in TF32 (about 1e-3 relative error against 1e-7; cuDNN's are on by default in torch 2.13), bf16/fp16 GEMMs reducing in
reduced precision, nondeterministic kernels, attention backends, autocast. A verdict is only understood with the
settings it was made under, so each report carries them as training had them when the check started
(``report.numerics``), and the JSON lines record and ``gradwatch report`` show them. A recomputed check's own
evaluations run in IEEE float32 whatever training uses
(:func:`gradwatch.engine.function.conditions.full_float32_precision`): :attr:`Numerics.tf32` says which paths of
training ran reduced, and the report's note says the check compared IEEE float32 instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["Numerics", "current_numerics", "describe_numerics"]


@dataclasses.dataclass(frozen=True)
class Numerics:
    """The numerics settings in force (see the module doc).

    Attributes:
        matmul: The float32 precision of CUDA matmuls: ``"ieee"`` or ``"tf32"`` (``torch.backends.cuda.matmul``'s
            ``fp32_precision``, or ``allow_tf32`` where that is not set).
        cudnn_conv: The float32 precision of cuDNN convolutions (``"tf32"`` by default).
        cudnn_rnn: The float32 precision of cuDNN RNNs (``"tf32"`` by default).
        mkldnn: The float32 precision of oneDNN (CPU) matmuls and convolutions (``"ieee"``, ``"tf32"`` or ``"bf16"``).
        reduced_reductions: The 16-bit dtypes whose GEMMs may reduce their partial sums in reduced precision
            (``allow_bf16_reduced_precision_reduction``, ``allow_fp16_reduced_precision_reduction``).
        deterministic: Whether ``torch.use_deterministic_algorithms(True)`` is on.
        cudnn_deterministic: ``torch.backends.cudnn.deterministic``.
        cudnn_benchmark: ``torch.backends.cudnn.benchmark`` (kernels picked by timing: a recomputation may run another
            algorithm than training).
        attention: The scaled-dot-product attention backends enabled (``flash``, ``efficient``, ``cudnn``, ``math``).
        autocast: Autocast as the check found it: ``"cuda:bfloat16"`` and the like, ``""`` when off.
    """

    matmul: str = "ieee"
    cudnn_conv: str = "tf32"
    cudnn_rnn: str = "tf32"
    mkldnn: str = "ieee"
    reduced_reductions: tuple[str, ...] = ()
    deterministic: bool = False
    _: dataclasses.KW_ONLY
    cudnn_deterministic: bool = False
    cudnn_benchmark: bool = False
    attention: tuple[str, ...] = ()
    autocast: str = ""

    @property
    def tf32(self) -> tuple[str, ...]:
        """The float32 paths that run in a reduced precision under these settings (``"matmul"``, ``"cudnn_conv"``,
        ...; ``()``: all IEEE)."""
        paths = {"matmul": self.matmul, "cudnn_conv": self.cudnn_conv, "cudnn_rnn": self.cudnn_rnn}
        paths["mkldnn"] = self.mkldnn
        return tuple(name for name, value in paths.items() if value not in ("ieee", "highest"))

    def reduced_on(self, device_type: str) -> tuple[str, ...]:
        """The float32 paths of :attr:`tf32` a model on ``device_type`` can run through: CUDA's matmul, cuDNN
        convolution and RNN on ``"cuda"``; elsewhere the matmul setting (``torch.set_float32_matmul_precision`` sets
        it with oneDNN's) and oneDNN's."""
        wanted = ("matmul", "cudnn_conv", "cudnn_rnn") if device_type == "cuda" else ("matmul", "mkldnn")
        return tuple(path for path in self.tf32 if path in wanted)

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain data (lists for tuples), as the JSON lines record writes them."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def describe(self) -> str:
        """The settings in one line, as ``gradwatch report`` shows them."""
        return describe_numerics(self.as_dict())


def describe_numerics(settings: Mapping[str, Any]) -> str:
    """One line of numerics settings, from :meth:`Numerics.as_dict` (or the JSON object read back); unknown keys are
    shown as they are, missing ones left out."""
    known = {f.name for f in dataclasses.fields(Numerics)}
    parts = [f"float32 {name.replace('_', ' ')} {settings[name]}" for name in ("matmul", "cudnn_conv", "cudnn_rnn",
             "mkldnn") if name in settings]  # fmt: skip
    reduced = settings.get("reduced_reductions")
    if reduced:
        parts.append(f"{'/'.join(map(str, reduced))} reduced-precision reductions")
    flags = [name.replace("_", " ") for name in ("deterministic", "cudnn_deterministic", "cudnn_benchmark")
             if settings.get(name)]  # fmt: skip
    parts += flags
    if "attention" in settings:
        parts.append(f"attention {'/'.join(map(str, settings['attention'])) or 'none'}")
    parts.append(f"autocast {settings.get('autocast') or 'off'}")
    parts += [f"{name} {value}" for name, value in settings.items() if name not in known]
    return ", ".join(parts)


def current_numerics() -> Numerics:
    """The settings in force now (read, never changed)."""
    backends = torch.backends
    flags = {"bf16": "allow_bf16_reduced_precision_reduction", "fp16": "allow_fp16_reduced_precision_reduction"}
    reduced = [name for name, flag in flags.items() if getattr(backends.cuda.matmul, flag, False)]
    readers = {"flash": "flash_sdp_enabled", "efficient": "mem_efficient_sdp_enabled", "cudnn": "cudnn_sdp_enabled"}
    readers["math"] = "math_sdp_enabled"
    attention = [name for name, reader in readers.items() if _called(backends.cuda, reader)]
    return Numerics(
        matmul=_fp32_precision(backends.cuda.matmul, backends.cuda.matmul),
        cudnn_conv=_fp32_precision(getattr(backends.cudnn, "conv", None), backends.cudnn),
        cudnn_rnn=_fp32_precision(getattr(backends.cudnn, "rnn", None), backends.cudnn),
        mkldnn=_fp32_precision(getattr(backends.mkldnn, "matmul", None), None),
        reduced_reductions=tuple(reduced),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        cudnn_deterministic=bool(backends.cudnn.deterministic),
        cudnn_benchmark=bool(backends.cudnn.benchmark),
        attention=tuple(attention),
        autocast=_autocast(),
    )


def _fp32_precision(settings: Any, legacy: Any) -> str:
    """One backend's float32 precision: its own ``fp32_precision``, else its parent's (``"none"`` inherits), else
    the legacy ``allow_tf32`` flag of ``legacy`` (read only then: torch raises on reading it once the new API set the
    precision)."""
    own = getattr(settings, "fp32_precision", "none")
    if own not in ("none", None):
        return str(own)
    parent = getattr(torch.backends, "fp32_precision", "none")
    if parent not in ("none", None):
        return str(parent)
    try:
        return "tf32" if legacy is not None and getattr(legacy, "allow_tf32", False) else "ieee"
    except RuntimeError:  # the legacy and the new API mixed
        return "unknown"


def _called(module: Any, name: str) -> bool:
    reader = getattr(module, name, None)
    try:
        return bool(reader()) if reader is not None else False
    except (RuntimeError, TypeError):
        return False


def _autocast() -> str:
    for device in ("cuda", "cpu", "xpu", "mps"):
        try:
            if torch.is_autocast_enabled(device):
                return f"{device}:{str(torch.get_autocast_dtype(device)).removeprefix('torch.')}"
        except (RuntimeError, TypeError, AttributeError):
            continue
    return ""


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
