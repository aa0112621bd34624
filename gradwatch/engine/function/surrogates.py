"""Stock layers whose gradient is deliberately not the derivative of their forward, checked on the function autograd
differentiates.

* ``spectral_norm`` (both torch's) in training mode runs a power-iteration step inside forward and treats its vectors
  ``u``, ``v`` as constants: the gradient is that of ``W / (uᵀWv)`` at fixed ``u``, ``v``. During a check they run as
  in evaluation mode: no iteration, the vectors constants to autograd and to the finite differences alike.
* ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``padding_idx``: the padding row gets a zero gradient by design and is
  not probed (:attr:`StockSurrogates.exempt`).
* ``nn.Embedding(scale_grad_by_freq=True)`` divides each row's gradient by its count in the batch: not probed.
* Fake quantisation (``torch.ao.quantization``'s ``FakeQuantize`` modules, enabled: quantisation-aware training): the
  loss is piecewise constant upstream of a quantiser, whose gradient is a straight-through estimator by design. A
  recomputed check (:attr:`StockSurrogates.quantisers_off`) runs the quantisers as the identity, which their backward
  differentiates: the rest of the model is checked on the float function they round; the estimators are not checked,
  the batch's inputs not probed. The applied check, which holds training's own gradient against the loss, keeps them
  on: that gradient is the estimators'.
* DoRA (PEFT's ``LoraConfig(use_dora=True)``: its ``Dora*Layer`` modules, recognised by name and ``get_weight_norm``)
  divides the adapted weight by its column norm, detached (the DoRA paper, section 4.3). During a check the values
  those modules detach are held at the reference's (:mod:`.held`, scoped to them), so the check differentiates what
  autograd does and a wrong backward of the adapter still fails.

:func:`find_stock_surrogates` says what a model has, with the note a report gives once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass, field

import torch
from torch import Tensor, nn

from gradwatch.engine.function.values import listed
from gradwatch.engine.results.notes import Note, NoteCode


@dataclass
class StockSurrogates:
    """What of a model is checked as autograd differentiates it rather than as its forward computes it.

    Attributes:
        power_iterations: The modules whose spectral norm runs without power iteration during a check.
        exempt: By parameter name, a mask of the coordinates that get a zero gradient by design (an embedding's
            padding row).
        unprobed: Parameters whose whole gradient is deliberately not the derivative (by name, with why).
    """

    power_iterations: list[nn.Module] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    exempt: dict[str, Tensor] = field(default_factory=dict)
    unprobed: dict[str, str] = field(default_factory=dict)
    fake_quantisers: list[str] = field(default_factory=list)
    weight_norms: list[nn.Module] = field(default_factory=list)
    """DoRA modules, whose detached weight norms a check holds constant."""
    _: KW_ONLY
    weight_norm_names: list[str] = field(default_factory=list)
    quantiser_modules: list[nn.Module] = field(default_factory=list)
    quantisers_off: bool = False  # a recomputed check runs the fake quantisers as the identity (see the module doc)

    def notes(self) -> list[Note]:
        """What a report says of them."""
        notes: list[Note] = []
        if self.names:
            notes.append(
                Note(
                    NoteCode.SPECTRAL_NORM,
                    f"spectral norm of {', '.join(self.names)} checked as autograd differentiates it: its "
                    "power-iteration vectors held constant (no iteration) during the check",
                )
            )
        for name, mask in self.exempt.items():
            rows = sorted({int(i) for i in mask.nonzero()[:, 0].tolist()})
            notes.append(
                Note(
                    NoteCode.PADDING_EXEMPT,
                    f"padding row {', '.join(map(str, rows))} of {name} not probed: it gets no gradient by design",
                )
            )
        notes += [Note(NoteCode.NOT_PROBED, f"{name} not probed: {why}") for name, why in self.unprobed.items()]
        if self.weight_norm_names:
            notes.append(
                Note(
                    NoteCode.DORA_NORM,
                    f"DoRA weight norms of {listed(self.weight_norm_names)} held constant during the check, as "
                    "autograd treats them (they are detached by design)",
                )
            )
        if self.fake_quantisers and self.quantisers_off:
            notes.append(
                Note(
                    NoteCode.FAKE_QUANTISATION,
                    f"fake quantisation enabled ({listed(self.fake_quantisers)}): checked as their straight-through "
                    "gradient differentiates them, as the identity (the float function they round); the estimators "
                    "themselves are not checked, the batch's inputs not probed",
                )
            )
        elif self.fake_quantisers:
            notes.append(
                Note(
                    NoteCode.FAKE_QUANTISATION,
                    f"fake quantisation enabled ({listed(self.fake_quantisers)}): the loss is piecewise "
                    "constant upstream of them and their gradient a straight-through estimator; the batch's inputs "
                    "are not probed",
                )
            )
        return notes


def _fake_quantising(module: nn.Module) -> bool:
    """A ``torch.ao.quantization`` fake quantiser with fake quantisation enabled."""
    quantization = getattr(torch.ao, "quantization", None)
    base = getattr(quantization, "FakeQuantizeBase", None)
    if base is None or not isinstance(module, base):
        return False
    enabled = getattr(module, "fake_quant_enabled", None)
    return bool(enabled[0]) if isinstance(enabled, Tensor) and enabled.numel() else True


def _dora(module: nn.Module) -> bool:
    """A PEFT DoRA module (``DoraLinearLayer`` and its kin), by duck typing: peft is not imported."""
    name = type(module).__name__.lstrip("_")
    return name.startswith("Dora") and name.endswith("Layer") and callable(getattr(module, "get_weight_norm", None))


def find_stock_surrogates(model: nn.Module) -> StockSurrogates:
    """The stock surrogate-gradient layers of ``model`` (see the module doc)."""
    found = StockSurrogates()
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if _fake_quantising(module):
            found.fake_quantisers.append(name or "the model")
            found.quantiser_modules.append(module)
        if type(module).__name__ == "_SpectralNorm" and module.training:
            found.power_iterations.append(module)
            found.names.append(name.removesuffix(".parametrizations.weight.0").removesuffix(".0") or "the model")
        hooks = module._forward_pre_hooks.values()
        if module.training and any(type(hook).__name__ == "SpectralNorm" for hook in hooks):
            found.power_iterations.append(module)
            found.names.append(name or "the model")
        if _dora(module):
            found.weight_norms.append(module)
            found.weight_norm_names.append(name.rsplit(".lora_magnitude_vector", 1)[0] or "the model")
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            weight_name = f"{prefix}weight"
            if getattr(module, "scale_grad_by_freq", False):
                found.unprobed[weight_name] = (
                    "scale_grad_by_freq=True divides each row's gradient by its count in the batch, by design"
                )
            elif module.padding_idx is not None:
                mask = torch.zeros_like(module.weight, dtype=torch.bool)
                mask[module.padding_idx] = True
                found.exempt[weight_name] = mask
    return found


@contextlib.contextmanager
def as_autograd_sees_them(found: StockSurrogates) -> Iterator[None]:
    """Run the spectral norms of ``found`` without power iteration for the duration, then put their modes back."""
    modes = [(module, module.training) for module in found.power_iterations]
    for module, _ in modes:
        module.training = False
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def quantisers_as_identity(found: StockSurrogates) -> Iterator[None]:
    """When :attr:`~StockSurrogates.quantisers_off`, run the fake quantisers of ``found`` as the identity for the
    duration (an instance attribute shadowing their ``forward``; entered before the check captures the model's
    state)."""
    quantisers = found.quantiser_modules if found.quantisers_off else []
    saved = [(module, vars(module).get("forward")) for module in quantisers]
    for module in quantisers:
        module.forward = _identity
    try:
        yield
    finally:
        for module, forward in saved:
            if forward is None:
                del module.forward
            else:
                module.forward = forward


def _identity(x: Tensor, *args: object, **kwargs: object) -> Tensor:
    """A fake quantiser's forward as its straight-through backward sees it."""
    return x
