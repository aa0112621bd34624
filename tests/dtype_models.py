"""Models whose parameters and buffers are of every dtype a check meets: a small Fourier neural operator (complex
spectral weights, as neuraloperator's FNO keeps them) and a model with a frozen float8 weight, a float8 buffer and an
integer buffer the forward increments."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SpectralConv2d(nn.Module):
    """The FNO's spectral convolution: ``rfft2``, the lowest ``modes`` frequencies mixed by a complex weight
    (``einsum``), ``irfft2``."""

    def __init__(self, channels: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        scale = 1 / (channels * channels)
        self.weight = nn.Parameter(scale * torch.randn(channels, channels, modes, modes, dtype=torch.cfloat))

    def forward(self, x: Tensor) -> Tensor:
        spectrum = torch.fft.rfft2(x)
        m = self.modes
        mixed = torch.zeros(x.shape[0], self.weight.shape[1], x.shape[-2], x.shape[-1] // 2 + 1, dtype=torch.cfloat)
        mixed[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", spectrum[:, :, :m, :m], self.weight)
        return torch.fft.irfft2(mixed, s=x.shape[-2:])


class FNO(nn.Module):
    """Lift, one Fourier layer with its pointwise skip, projection: a field to a field."""

    def __init__(self, width: int = 4, modes: int = 3) -> None:
        super().__init__()
        self.lift = nn.Conv2d(1, width, 1)
        self.spectral = SpectralConv2d(width, modes)
        self.skip = nn.Conv2d(width, width, 1)
        self.project = nn.Conv2d(width, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lift(x)
        return self.project(F.gelu(self.spectral(h) + self.skip(h)))


def field_batches(count: int, size: int = 8, samples: int = 4) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(1)
    shape = (samples, 1, size, size)
    return [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)) for _ in range(count)]


def field_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


class QuantisedSide(nn.Module):
    """A trainable linear beside a frozen float8 weight (a quantised base, dequantised in the forward with a float8
    scale), a BatchNorm, and an integer buffer counting the forwards. (A *trainable* float8 parameter cannot train on
    CPU: torch 2.13 has no float8 gradient accumulation there, ``"add_stub" not implemented for 'Float8_e4m3fn'``.)"""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.randn(6, 4).to(torch.float8_e4m3fn), requires_grad=False)
        self.register_buffer("scale", torch.tensor([0.5]).to(torch.float8_e5m2))
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))
        self.adapter = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        self.forwards += 1
        h = self.adapter(x) + x @ (self.base.float() * self.scale.float()).t()
        return self.head(torch.tanh(self.norm(h)))
