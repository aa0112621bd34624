"""A diffusers ``UNet2DModel`` of realistic shape (three resolutions, attention in the two lower ones), small enough for
CPU, with a planted backward bug in one attention: a projection's backward (``to_q``, ``to_k``, ``to_v``,
``to_out.0``) or the attention processor's softmax backward. For ``tests/integrations/test_diffusers_unet.py`` and
``benchmarks/unet_detection.py``; diffusers is optional (the callers skip without it).

The data are what a DDPM training step sees: images, Gaussian noise, random timesteps, the images noised by the
scheduler's ``add_noise``, and the loss is the mean squared error of the predicted noise.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from culprit_models import plant_linear_bug
from torch import Tensor, nn


class WrongSoftmaxAttention(torch.autograd.Function):
    """``scaled_dot_product_attention`` whose backward scales the gradient through the softmax by ``factor``: the
    gradients of the query and the key are ``factor`` times their value, the value's is right."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(query, key, value)
        ctx.factor = factor
        return F.scaled_dot_product_attention(query, key, value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        query, key, value = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(query, key, value)
            grad_q, grad_k, grad_v = torch.autograd.grad(out, (query, key, value), grad)
        return grad_q * ctx.factor, grad_k * ctx.factor, grad_v, None


class SoftmaxBugProcessor:
    """diffusers' ``AttnProcessor2_0`` for the self-attention of a UNet block (no mask), its attention product taken
    through :class:`WrongSoftmaxAttention`: the bug lives in the ``Attention`` module's own forward."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        temb: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        residual = hidden_states
        batch, channels, height, width = hidden_states.shape
        hidden_states = hidden_states.view(batch, channels, height * width).transpose(1, 2)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads

        def heads(t: Tensor) -> Tensor:
            return t.view(batch, -1, attn.heads, head_dim).transpose(1, 2)

        out = WrongSoftmaxAttention.apply(heads(query), heads(key), heads(value), self.factor)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim)
        out = attn.to_out[1](attn.to_out[0](out))
        out = out.transpose(-1, -2).reshape(batch, channels, height, width)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


ATTENTIONS = ("down_blocks.2.attentions.0", "mid_block.attentions.0", "up_blocks.0.attentions.1")
"""Three of the model's attentions: the deepest down block's, the mid block's, the first up block's."""

BUGS = {
    "to_q weight": ("up_blocks.0.attentions.1.to_q", "weight"),
    "to_k input": ("down_blocks.2.attentions.0.to_k", "input"),
    "to_v weight": ("mid_block.attentions.0.to_v", "weight"),
    "to_out input": ("mid_block.attentions.0.to_out.0", "input"),
    "softmax": ("up_blocks.0.attentions.1", "softmax"),
    "to_q input": ("up_blocks.0.attentions.1.to_q", "input"),
    "to_v input": ("mid_block.attentions.0.to_v", "input"),
    "to_out weight": ("mid_block.attentions.0.to_out.0", "weight"),
}
"""The planted bugs: the module holding each and which gradient it gets wrong."""


def unet(
    bug: str | None = None,
    factor: float = 1.02,
    *,
    channels: tuple[int, ...] = (64, 128, 256),
    layers_per_block: int = 1,
    seed: int = 0,
) -> nn.Module:
    """A random-init ``UNet2DModel`` for 32×32 RGB images (attention in the two lower resolutions and the mid block),
    with the bug ``bug`` (a key of :data:`BUGS`) planted at ``factor``."""
    from diffusers import UNet2DModel

    torch.manual_seed(seed)
    model = UNet2DModel(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        layers_per_block=layers_per_block,
        block_out_channels=channels,
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=32,
        norm_num_groups=min(32, channels[0]),
    )
    if bug is not None:
        holder, where = BUGS[bug]
        if where == "softmax":
            model.get_submodule(holder).set_processor(SoftmaxBugProcessor(factor))
        else:
            plant_linear_bug(model.get_submodule(holder), factor, where)  # type: ignore[arg-type]
    return model


def small_unet(bug: str, factor: float = 1.02) -> nn.Module:
    """The culprit benchmark's small ``UNet2DModel`` (16×16, channels 16 and 32, attention in the lower resolution and
    the mid block) with a ``factor`` input-gradient bug planted in the linear layer ``bug``."""
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    model = UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
        attention_head_dim=8,
    )
    plant_linear_bug(model.get_submodule(bug), factor)  # type: ignore[arg-type]
    return model


def small_unet_batch() -> tuple[Tensor, Tensor, Tensor]:
    """Four random 16×16 images, their timesteps across the schedule, and the noise to predict."""
    generator = torch.Generator().manual_seed(0)
    images, noise = torch.randn(4, 3, 16, 16, generator=generator), torch.randn(4, 3, 16, 16, generator=generator)
    return images, torch.tensor([10, 200, 500, 900]), noise


def ddpm_batches(count: int, size: int = 4, seed: int = 0, resolution: int = 32) -> list[tuple[Tensor, Tensor, Tensor]]:
    """``count`` DDPM training batches of ``size`` images: noisy images (``add_noise``), timesteps, the noise."""
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler(num_train_timesteps=1000)
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        # smooth synthetic "images": low-frequency patterns upsampled, in [-1, 1] as a DDPM pipeline normalises them
        low = torch.randn(size, 3, 8, 8, generator=generator)
        images = torch.tanh(F.interpolate(low, size=resolution, mode="bilinear"))
        noise = torch.randn(size, 3, resolution, resolution, generator=generator)
        timesteps = torch.randint(0, 1000, (size,), generator=generator)
        batches.append((scheduler.add_noise(images, noise, timesteps), timesteps, noise))
    return batches


def noise_prediction_loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """The DDPM loss: the mean squared error of the predicted noise."""
    return F.mse_loss(model(batch[0], batch[1]).sample, batch[2])
