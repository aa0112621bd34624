"""Models of the kinds third-party libraries train, shared by the tests and ``benchmarks/library_models.py``.

Tiny configs, random init, synthetic data made on the spot, nothing downloaded. Each :class:`LibraryCase` builds a
model, its batches and its loss as the library's docs train it; ``bug`` cases carry a planted 5% backward error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ScaledBackward(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor``: a planted bug in a hand-written backward.
    Differentiable twice (its backward is built from differentiable ops) and vmap-able, so double-backward losses and
    vectorised passes can use it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, factor: float) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


# --- shared modules -------------------------------------------------------------------------------------------------


class SharedGate(nn.Module):
    """A decoder that reuses the encoder's gate: one module under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 6)
        self.dec = self.enc
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.dec(torch.tanh(self.enc(x)))))


class TiedWeights(nn.Module):
    """An embedding and an output layer sharing one weight (a language model's tied embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8, bias=False)
        self.out = nn.Linear(8, 6, bias=False)
        self.out.weight = nn.Parameter(self.embed.weight.detach().t().contiguous())
        self.proj = nn.Linear(8, 8)
        self.tied = nn.Linear(8, 8)
        self.tied.weight = self.proj.weight
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.embed(x)) * self.scale
        return self.out(torch.tanh(self.tied(torch.tanh(self.proj(h)))))[:, :1]


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.log_noise = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class MarginalLikelihood(nn.Module):
    """A Gaussian-process-style objective object: holds the model and its likelihood a second time."""

    def __init__(self, model: Regressor) -> None:
        super().__init__()
        self.model = model
        self.likelihood = model  # GP libraries keep model.likelihood and mll.likelihood both

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        noise = F.softplus(self.likelihood.log_noise) + 1e-3
        return 0.5 * (((self.model(x) - y) ** 2) / noise + torch.log(noise)).mean()


class NoiseLikelihood:
    """A library's likelihood object (not a module) that holds the model's noise parameter itself."""

    def __init__(self, log_noise: Tensor) -> None:
        self.log_noise = log_noise

    def __call__(self, pred: Tensor, target: Tensor) -> Tensor:
        return (((pred - target) ** 2) * torch.exp(-self.log_noise) + self.log_noise).mean()


def _with_likelihood() -> nn.Module:
    model = Regressor()
    model.likelihood_object = NoiseLikelihood(model.log_noise)  # a plain attribute: outside the module tree
    return model


def likelihood_loss(model: nn.Module, batch: Any) -> Tensor:
    x, y = batch
    return model.likelihood_object(model(x), y)


def mse(model: nn.Module, batch: Any) -> Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def target_asserting_mse(model: nn.Module, batch: Any) -> Tensor:
    """A metric library's loss that refuses a target requiring grad."""
    x, y = batch
    assert not y.requires_grad, "target must not require grad"
    return F.mse_loss(model(x), y)


def regression_batches(features: int = 6, size: int = 8, n: int = 4, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, features, generator=g), torch.randn(size, 1, generator=g)) for _ in range(n)]


# --- graph networks -------------------------------------------------------------------------------------------------


class GCN(nn.Module):
    def __init__(self, features: int = 5, hidden: int = 8, classes: int = 3) -> None:
        super().__init__()
        from torch_geometric.nn import GCNConv, global_mean_pool

        self.conv1 = GCNConv(features, hidden)
        self.conv2 = GCNConv(hidden, hidden)
        self.head = nn.Linear(hidden, classes)
        self.pool = global_mean_pool

    def forward(self, data: Any) -> Tensor:
        h = torch.tanh(self.conv1(data.x, data.edge_index))
        h = torch.tanh(self.conv2(h, data.edge_index))
        return self.head(self.pool(h, data.batch))


def graph_batches(n: int = 4, graphs: int = 16, seed: int = 0) -> list[Any]:
    from torch_geometric.data import Batch, Data

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        items = []
        for _ in range(graphs):
            nodes = int(torch.randint(4, 8, (), generator=g))
            edges = torch.randint(0, nodes, (2, 2 * nodes), generator=g)
            y = torch.randint(0, 3, (1,), generator=g)
            items.append(Data(x=torch.randn(nodes, 5, generator=g), edge_index=edges, y=y))
        out.append(Batch.from_data_list(items))
    return out


def graph_loss(model: nn.Module, data: Any) -> Tensor:
    return F.cross_entropy(model(data), data.y)


# --- spectral (Fourier neural operator) -----------------------------------------------------------------------------


class SpectralConv(nn.Module):
    def __init__(self, channels: int, modes: int, bug: float = 1.0) -> None:
        super().__init__()
        self.modes = modes
        self.bug = bug
        scale = 1 / channels
        self.weight = nn.Parameter(scale * torch.randn(channels, channels, modes, dtype=torch.cfloat))

    def forward(self, x: Tensor) -> Tensor:
        spectrum = torch.fft.rfft(x)
        weight = self.weight if self.bug == 1.0 else ScaledBackward.apply(self.weight, self.bug)
        mixed = torch.einsum("bim,iom->bom", spectrum[..., : self.modes], weight)
        out = torch.zeros_like(spectrum)
        out[..., : self.modes] = mixed
        return torch.fft.irfft(out, n=x.shape[-1])


class FNO(nn.Module):
    def __init__(self, channels: int = 4, modes: int = 6, bug: float = 1.0) -> None:
        super().__init__()
        self.lift = nn.Conv1d(1, channels, 1)
        self.spectral = SpectralConv(channels, modes, bug)
        self.skip = nn.Conv1d(channels, channels, 1)
        self.project = nn.Conv1d(channels, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lift(x)
        h = torch.tanh(self.spectral(h) + self.skip(h))
        return self.project(h)


def field_batches(n: int = 4, size: int = 4, length: int = 32, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 1, length, generator=g), torch.randn(size, 1, length, generator=g)) for _ in range(n)]


# --- losses that differentiate inside themselves --------------------------------------------------------------------


class PINN(nn.Module):
    def __init__(self, bug: float = 1.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.bug = bug

    def forward(self, xt: Tensor) -> Tensor:
        h = self.net[1](self.net[0](xt))
        if self.bug != 1.0:
            h = ScaledBackward.apply(h, self.bug)
        return self.net[4](self.net[3](self.net[2](h)))


def pinn_loss(model: nn.Module, batch: Any) -> Tensor:
    """A heat-equation residual u_t - 0.1 u_xx at collocation points, plus a boundary term."""
    collocation, boundary, boundary_u = batch
    xt = collocation.detach().requires_grad_(True)
    u = model(xt)
    (du,) = torch.autograd.grad(u.sum(), xt, create_graph=True)
    u_x, u_t = du[:, 0], du[:, 1]
    (du_x,) = torch.autograd.grad(u_x.sum(), xt, create_graph=True)
    residual = u_t - 0.1 * du_x[:, 0]
    return residual.pow(2).mean() + F.mse_loss(model(boundary), boundary_u)


def pinn_batches(n: int = 4, seed: int = 0) -> list[tuple[Tensor, Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        boundary = torch.rand(8, 2, generator=g)
        out.append((torch.rand(16, 2, generator=g), boundary, torch.sin(math.pi * boundary[:, :1])))
    return out


class Critic(nn.Module):
    def __init__(self, bug: float = 1.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.bug = bug

    def forward(self, x: Tensor) -> Tensor:
        h = self.net[1](self.net[0](x))
        if self.bug != 1.0:
            h = ScaledBackward.apply(h, self.bug)
        return self.net[4](self.net[3](self.net[2](h)))


def wgan_gp_loss(critic: nn.Module, batch: Any) -> Tensor:
    """The WGAN-GP critic loss: Wasserstein estimate plus a gradient penalty at interpolates."""
    real, fake, mix = batch
    interpolates = (mix * real + (1 - mix) * fake).detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(critic(interpolates).sum(), interpolates, create_graph=True)
    penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
    return critic(fake).mean() - critic(real).mean() + 10 * penalty


def critic_batches(n: int = 4, seed: int = 0) -> list[tuple[Tensor, Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 4, generator=g) + 1, torch.randn(8, 4, generator=g), torch.rand(8, 1, generator=g))
        for _ in range(n)
    ]


# --- causal transformer, QAT, mixture of experts --------------------------------------------------------------------


class CausalTransformer(nn.Module):
    """The PyTorch tutorial's way: a causal mask built in forward with ``torch.full(..., -inf).triu(1)``."""

    def __init__(self, vocab: int = 16, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layer = nn.TransformerEncoderLayer(width, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)
        return self.head(self.layer(self.embed(tokens), mask))


def lm_loss(model: nn.Module, batch: Any) -> Tensor:
    tokens = batch[0]
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def token_batches(n: int = 4, vocab: int = 16, size: int = 4, length: int = 10, seed: int = 0) -> list[tuple[Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (size, length), generator=g),) for _ in range(n)]


class QATNet(nn.Module):
    """Quantisation-aware training with PyTorch's fused fake-quant modules on weights and activations."""

    def __init__(self, bug: float = 1.0) -> None:
        super().__init__()
        from torch.ao.quantization import FusedMovingAvgObsFakeQuantize

        self.bug = bug  # a planted bug: the backward of the activation before fc2 scaled by this factor
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 1)
        self.act_fq = FusedMovingAvgObsFakeQuantize()
        self.w_fq = FusedMovingAvgObsFakeQuantize(
            quant_min=-128, quant_max=127, dtype=torch.qint8, qscheme=torch.per_tensor_symmetric
        )

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(F.linear(x, self.w_fq(self.fc1.weight), self.fc1.bias))
        h = h if self.bug == 1.0 else ScaledBackward.apply(h, self.bug)
        return self.fc2(self.act_fq(h))


class TinyMoE(nn.Module):
    """Top-2 routing with ``nonzero``: data-dependent shapes that vmap refuses."""

    def __init__(self, width: int = 16, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.inp = nn.Linear(6, width)
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 32), nn.ReLU(), nn.Linear(32, width)) for _ in range(experts)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.inp(x))
        weights, chosen = self.router(h).topk(self.k, dim=-1)
        weights = torch.softmax(weights, dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, weights[rows, slot, None] * expert(h[rows]))
        return self.head(h + out)


class CouplingFlow(nn.Module):
    """A RealNVP-style flow whose forward leaves its loop early on a data-dependent test (``float(...)``, as adaptive
    solvers do): vmap refuses it."""

    def __init__(self, features: int = 6, layers: int = 4) -> None:
        super().__init__()
        half = features // 2
        self.nets = nn.ModuleList(
            nn.Sequential(nn.Linear(half, 32), nn.Tanh(), nn.Linear(32, 2 * half)) for _ in range(layers)
        )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logdet = x.new_zeros(x.shape[0])
        for i, net in enumerate(self.nets):
            a, b = x.chunk(2, dim=-1)
            if i % 2:
                a, b = b, a
            scale, shift = net(a).chunk(2, dim=-1)
            scale = torch.tanh(scale)
            b = b * torch.exp(scale) + shift
            logdet = logdet + scale.sum(-1)
            if float(b.abs().max()) > 1e6:  # a data-dependent exit
                break
            x = torch.cat([b, a] if i % 2 else [a, b], dim=-1)
        return x, logdet


def flow_loss(model: nn.Module, batch: Any) -> Tensor:
    z, logdet = model(batch[0])
    return (0.5 * z.pow(2).sum(-1) - logdet).mean()


# --- the matrix -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LibraryCase:
    """A model, its batches and its loss; ``bug`` is the planted error's description (empty for a correct model)."""

    name: str
    build: Callable[[], nn.Module]
    batches: Callable[[], list[Any]]
    loss_fn: Callable[[nn.Module, Any], Tensor]
    bug: str = ""
    expected: str = "ok"
    """The verdict every check of a correct model should reach (QAT: inconclusive, its loss is piecewise constant)."""


def _fabric_wrapped() -> nn.Module:
    import lightning

    fabric = lightning.fabric.Fabric(accelerator="cpu", devices=1)
    return fabric.setup(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)))


def _tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=16, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(config)


def hf_loss(model: nn.Module, batch: Any) -> Tensor:
    return model(input_ids=batch[0], labels=batch[0]).loss


def _gp_object() -> nn.Module:
    return MarginalLikelihood(Regressor())


def gp_loss(mll: nn.Module, batch: Any) -> Tensor:
    x, y = batch
    return mll(x, y)


CORRECT = (
    LibraryCase("shared gate (dec = enc)", SharedGate, regression_batches, mse),
    LibraryCase("tied weights", TiedWeights, regression_batches, mse),
    LibraryCase("Fabric wrapper", _fabric_wrapped, regression_batches, mse),
    LibraryCase("GP-like objective (model held twice)", _gp_object, regression_batches, gp_loss),
    LibraryCase("parameter held outside the tree", _with_likelihood, regression_batches, likelihood_loss),
    LibraryCase("target asserted without grad", Regressor, regression_batches, target_asserting_mse),
    LibraryCase("torch_geometric GCN", GCN, graph_batches, graph_loss),
    LibraryCase("FNO (complex weights)", FNO, field_batches, mse),
    LibraryCase("PINN (heat residual)", PINN, pinn_batches, pinn_loss),
    LibraryCase("WGAN-GP critic", Critic, critic_batches, wgan_gp_loss),
    LibraryCase("causal transformer (-inf mask)", CausalTransformer, token_batches, lm_loss),
    LibraryCase("Hugging Face GPT-2 (tiny)", _tiny_gpt2, token_batches, hf_loss),
    LibraryCase("QAT (fused fake quant)", QATNet, regression_batches, mse),
    LibraryCase("MoE (top-2, nonzero)", TinyMoE, regression_batches, mse),
    LibraryCase("coupling flow (data-dependent exit)", CouplingFlow, regression_batches, flow_loss),
)

BUGGY = (
    LibraryCase("FNO, 5% on the complex weight", lambda: FNO(bug=1.05), field_batches, mse, bug="spectral.weight"),
    LibraryCase("PINN, 5% in a hidden backward", lambda: PINN(bug=1.05), pinn_batches, pinn_loss, bug="net.0"),
    LibraryCase(
        "WGAN-GP, 5% in a hidden backward", lambda: Critic(bug=1.05), critic_batches, wgan_gp_loss, bug="net.0"
    ),
)
