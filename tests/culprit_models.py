"""Models with a planted wrong backward at a known module, for the culprit tests (``tests/engine/test_culprits.py``)
and ``benchmarks/culprits.py``: a deep residual stack, a bug in the loss, in functional code between modules, in a
shared module called twice, in a module with tuple and integer outputs, and in a tiny Hugging Face Llama's RMSNorm."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class WrongInputGradient(torch.autograd.Function):
    """``tanh`` whose backward scales the input gradient by ``factor`` (1 is correct)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, float], output: Tensor) -> None:  # type: ignore[override]
        ctx.save_for_backward(output)
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y) * ctx.factor, None


class Tanh(nn.Module):
    """A hand-written ``tanh``; ``factor`` plants a bug in its backward."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return WrongInputGradient.apply(x, self.factor)


class Block(nn.Module):
    def __init__(self, width: int, factor: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = Tanh(factor)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x + self.act(self.fc(x)))  # a residual stream: the error reaches upstream by two paths


class Stack(nn.Module):
    def __init__(self, depth: int = 6, bug_at: int | None = None, width: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width, 1.03 if i == bug_at else 1.0) for i in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=generator), torch.randint(0, 3, (6,), generator=generator)


def _cross_entropy(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


class WrongLossGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor) -> Tensor:
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad * 1.03


class Functional(nn.Module):
    """A bug in plain functional code between two modules of the model's own forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 12)
        self.second = nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(WrongInputGradient.apply(self.first(x), 1.03))


class Shared(nn.Module):
    """One buggy module called twice (shared weights), between two healthy ones."""

    def __init__(self, factor: float = 1.03) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 12)
        self.shared = nn.Sequential(nn.Linear(12, 12), Tanh(factor))
        self.out = nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.shared(self.shared(self.inp(x))))


class PairOutput(nn.Module):
    """Returns ``(values, indices)``: a floating and an integer output."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.act = Tanh(factor)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = self.act(x)
        return y, y.argmax(-1)


class TupleModel(nn.Module):
    def __init__(self, factor: float = 1.03) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 12)
        self.pair = PairOutput(factor)
        self.out = nn.Sequential(nn.Linear(12, 3), nn.ReLU(inplace=True))  # in place on the activation probed

    def forward(self, x: Tensor) -> Tensor:
        values, indices = self.pair(self.inp(x))
        return self.out(values) + 0.0 * indices.unsqueeze(-1)


def batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=generator), torch.randint(0, 3, (6,), generator=generator)


def cross_entropy(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def loss_with_wrong_backward(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(WrongLossGradient.apply(model(batch[0])), batch[1])


def llama_with_wrong_norm(norm: str | None, layers: int = 3) -> nn.Module:
    """A tiny ``LlamaForCausalLM`` whose RMSNorm ``norm`` (a module name) runs a backward that drops a term."""
    import transformers

    from gradwatch.cli.demo_models import RMSNormFunction

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(config)
    if norm is not None:
        module = dict(model.named_modules())[norm]

        def forward(hidden_states: Tensor) -> Tensor:
            return RMSNormFunction.apply(hidden_states, module.weight, module.variance_epsilon, False)

        module.forward = forward  # type: ignore[method-assign]
    return model


def tokens() -> Tensor:
    return torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))


def causal_lm_loss(model: nn.Module, ids: Tensor) -> Tensor:
    return model(input_ids=ids, labels=ids).loss


# ---- bugs planted in library modules: a linear layer, an embedding, a norm, a residual branch ---------------------


class ScaledLinear(torch.autograd.Function):
    """``F.linear`` whose backward scales the input gradient (``where="input"``) or the weight gradient
    (``where="weight"``) by ``factor``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, weight: Tensor, bias: Tensor | None, factor: float, where: str) -> Tensor:  # type: ignore[override]
        return F.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:  # type: ignore[override]
        x, weight, bias, ctx.factor, ctx.where = inputs
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight
        grad_w = grad.reshape(-1, grad.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        if ctx.where == "input":
            grad_x = grad_x * ctx.factor
        else:
            grad_w = grad_w * ctx.factor
        return grad_x, grad_w, grad_b, None, None


def plant_linear_bug(module: nn.Linear, factor: float = 1.02, where: str = "input") -> None:
    """Make ``module``'s backward scale its input (or weight) gradient by ``factor``."""

    def forward(x: Tensor) -> Tensor:
        return ScaledLinear.apply(x, module.weight, module.bias, factor, where)

    module.forward = forward  # type: ignore[method-assign]


class ScaledEmbedding(torch.autograd.Function):
    """An embedding lookup whose weight gradient is scaled by ``factor``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(ids: Tensor, weight: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        return F.embedding(ids, weight)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, float], output: Tensor) -> None:  # type: ignore[override]
        ids, weight, ctx.factor = inputs
        ctx.save_for_backward(ids)
        ctx.rows = weight.shape[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None]:  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        grad_w = torch.zeros(ctx.rows, grad.shape[-1], dtype=grad.dtype, device=grad.device)
        grad_w.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]))
        return None, grad_w * ctx.factor, None


def llama_with_bug(module_name: str | None, factor: float = 1.02, where: str = "input", layers: int = 2) -> nn.Module:
    """A tiny ``LlamaForCausalLM`` with a ``factor`` backward bug planted in ``module_name``: a linear layer (its input
    or weight gradient), the token embedding (its weight gradient) or an RMSNorm (the demo's dropped term)."""
    model = llama_with_wrong_norm(None, layers=layers)
    if module_name is None:
        return model
    module = dict(model.named_modules())[module_name]
    if isinstance(module, nn.Linear):
        plant_linear_bug(module, factor, where)
    elif isinstance(module, nn.Embedding):
        embedding = module

        def embed(ids: Tensor) -> Tensor:
            return ScaledEmbedding.apply(ids, embedding.weight, factor)

        embedding.forward = embed  # type: ignore[method-assign]
    else:
        from gradwatch.cli.demo_models import RMSNormFunction

        def norm(hidden_states: Tensor) -> Tensor:
            return RMSNormFunction.apply(hidden_states, module.weight, module.variance_epsilon, False)

        module.forward = norm  # type: ignore[method-assign]
    return model


class ResidualBranchBlock(nn.Module):
    """``x + branch(x)``, the branch a linear layer, an activation and another linear layer; ``factor`` plants a bug in
    the branch's activation."""

    def __init__(self, width: int, factor: float) -> None:
        super().__init__()
        self.branch = nn.Sequential(nn.Linear(width, 2 * width), Tanh(factor), nn.Linear(2 * width, width))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x + self.branch(x))


class Residual(nn.Module):
    """Four residual blocks; the bug sits in block ``bug_at``'s branch."""

    def __init__(self, bug_at: int = 1, factor: float = 1.02, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 12)
        self.blocks = nn.ModuleList(ResidualBranchBlock(12, factor if i == bug_at else 1.0) for i in range(4))
        self.head = nn.Linear(12, 3)
        self.checkpointed = checkpointed

    def forward(self, x: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)
        return self.head(h)


class NormMLP(nn.Module):
    """The historical RMSNorm bug in a small MLP: blocks of ``fc1``, RMSNorm, ``fc2`` with GELU; the norm of block
    ``bug_at`` drops a term of its backward, an error close to the float32 tolerance."""

    def __init__(self, bug_at: int = 1, blocks: int = 3, width: int = 16) -> None:
        super().__init__()
        from gradwatch.cli.demo_models import RMSNorm

        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Linear(width, width),
                RMSNorm(width, correct_backward=i != bug_at),
                nn.GELU(),
                nn.Linear(width, width),
            )
            for i in range(blocks)
        )
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = x.repeat(1, 2)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


# ---- a diffusion UNet in miniature, with attention --------------------------------------------------------------


class ResBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(4, channels_in)
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, padding=1)
        self.norm2 = nn.GroupNorm(4, channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(channels_in, channels_out, 1) if channels_in != channels_out else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))
        return h + (self.conv_shortcut(x) if self.conv_shortcut is not None else x)


class Attention(nn.Module):
    """Self-attention over the pixels, as diffusers' ``Attention`` in a UNet's mid block."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(4, channels)
        self.to_q, self.to_k, self.to_v = (nn.Linear(channels, channels) for _ in range(3))
        self.to_out = nn.Linear(channels, channels)

    def forward(self, x: Tensor) -> Tensor:
        b, c, height, width = x.shape
        h = self.group_norm(x).flatten(2).transpose(1, 2)
        q, k, v = self.to_q(h), self.to_k(h), self.to_v(h)
        weights = torch.softmax(q @ k.transpose(1, 2) / c**0.5, dim=-1)
        out = self.to_out(weights @ v).transpose(1, 2).reshape(b, c, height, width)
        return x + out


class TinyUNet(nn.Module):
    """A UNet of two resolutions with attention at the lower one, predicting the noise of noisy images;
    ``bug`` plants a 2% input-gradient bug in the named linear layer (``"mid.attention.to_out"``, say)."""

    def __init__(self, bug: str | None = None, factor: float = 1.02) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv_in = nn.Conv2d(3, 8, 3, padding=1)
        self.down = ResBlock(8, 16)
        self.downsample = nn.Conv2d(16, 16, 3, stride=2, padding=1)
        self.mid = nn.ModuleDict({"res": ResBlock(16, 16), "attention": Attention(16)})
        self.upsample = nn.ConvTranspose2d(16, 16, 2, stride=2)
        self.up = ResBlock(32, 8)
        self.conv_out = nn.Conv2d(8, 3, 3, padding=1)
        if bug is not None:
            plant_linear_bug(self.get_submodule(bug), factor)  # type: ignore[arg-type]

    def forward(self, x: Tensor) -> Tensor:
        skip = self.down(self.conv_in(x))
        h = self.mid["attention"](self.mid["res"](self.downsample(skip)))
        return self.conv_out(self.up(torch.cat([self.upsample(h), skip], 1)))


def noisy_images() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(3)
    images, noise = torch.randn(4, 3, 16, 16, generator=generator), torch.randn(4, 3, 16, 16, generator=generator)
    return 0.8 * images + 0.6 * noise, noise


def noise_prediction_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.mse_loss(model(batch[0]), batch[1])
