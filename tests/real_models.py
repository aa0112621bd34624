"""The models users train whose probes must evaluate the user's own function: Hugging Face causal LMs that cast to
float32 inside their loss, generative models that draw noise in their input's dtype, stock layers whose gradient is a
surrogate by design, and user surrogates (a GAN's per-optimizer losses, a straight-through fake quantiser).

Each is a LightningModule built from a tiny config with random init on synthetic data made on the spot, with the
``GradWatch`` callbacks its README advice gives (:attr:`RealModel.watches`). Used by
``tests/lightning/test_real_models.py`` and ``benchmarks/real_models.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrizations
from torch.utils.data import DataLoader, TensorDataset

from gradwatch import GradWatch

VOCAB = 64


class ScaledWeightGradient(torch.autograd.Function):
    """``x @ weight.T`` with a hand-written backward whose weight gradient is multiplied by ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, factor: float) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.factor = factor
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight = ctx.saved_tensors
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad @ weight, grad_weight * ctx.factor, None


def _token_loader(batches: int = 4, size: int = 4, length: int = 12) -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (batches * size, length), generator=generator)
    labels = torch.randint(0, 3, (batches * size,), generator=generator)
    return DataLoader(TensorDataset(tokens, labels), batch_size=size)


def _vector_loader(features: int, batches: int = 4, size: int = 8) -> DataLoader:
    generator = torch.Generator().manual_seed(4)
    return DataLoader(TensorDataset(torch.randn(batches * size, features, generator=generator)), batch_size=size)


class _Module(pl.LightningModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class CausalLM(_Module):
    """A Hugging Face causal LM (GPT-2 or Llama) from a tiny config, its own loss (logits cast to float32 inside);
    ``lora`` wraps it in a ``peft`` LoRA whose adapters' B matrices run through a hand-written backward
    (``lora_bug`` scales their weight gradient)."""

    def __init__(self, arch: str = "llama", lora: bool = False, lora_bug: float = 1.0) -> None:
        super().__init__()
        import transformers

        if arch == "gpt2":
            config: Any = transformers.GPT2Config(
                vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.1, embd_pdrop=0.1
            )
            self.model = transformers.GPT2LMHeadModel(config)
        else:
            config = transformers.LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=32,
            )
            self.model = transformers.LlamaForCausalLM(config)
        if lora:
            import peft

            config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
            self.model = peft.get_peft_model(self.model, config)
            for module in self.model.modules():
                if isinstance(module, peft.tuners.lora.LoraLayer):
                    _hand_written_backward(module.lora_B["default"], lora_bug)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, _ = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", loss)
        return loss


def _hand_written_backward(linear: nn.Linear, factor: float) -> None:
    """Route ``linear`` (no bias) through :class:`ScaledWeightGradient`, a custom kernel's backward."""

    def forward(x: Tensor) -> Tensor:
        return ScaledWeightGradient.apply(x, linear.weight, factor)

    linear.forward = forward  # type: ignore[method-assign]


class Bert(_Module):
    """``BertForSequenceClassification`` from a tiny config, its own loss, dropout on."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
            num_labels=3,
        )
        self.model = transformers.BertForSequenceClassification(config)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, labels = batch
        return self.model(input_ids=tokens, labels=labels).loss


class VAE(_Module):
    """A VAE whose reparameterisation draws ``torch.randn_like(mu)``; ``decoder_bug`` scales the decoder's weight
    gradient in a hand-written backward."""

    def __init__(self, decoder_bug: float = 1.0) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(12, 32), nn.SiLU(), nn.Linear(32, 2 * 4))
        self.decoder_in = nn.Linear(4, 32)
        self.decoder_out = nn.Linear(32, 12, bias=False)
        if decoder_bug != 1.0:
            _hand_written_backward(self.decoder_out, decoder_bug)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (x,) = batch
        mu, log_var = self.encoder(x).chunk(2, dim=-1)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * log_var)
        recon = self.decoder_out(F.silu(self.decoder_in(z)))
        kl = -0.5 * torch.mean(1 + log_var - mu.square() - log_var.exp())
        loss = F.mse_loss(recon, x) + 0.1 * kl
        self.log("train_loss", loss)
        return loss


class GAN(pl.LightningModule):
    """A GAN trained with manual optimization; its latents are drawn ``torch.randn(..., dtype=x.dtype)``. The loss of
    each optimizer is a function of its own (:meth:`generator_loss`, :meth:`discriminator_loss`)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def _fake(self, x: Tensor) -> Tensor:
        latent = torch.randn(x.shape[0], 4, dtype=x.dtype, device=x.device)
        return self.generator(latent)

    @staticmethod
    def generator_loss(module: GAN, batch: Any) -> Tensor:
        (x,) = batch
        scores = module.discriminator(module._fake(x))
        return F.binary_cross_entropy_with_logits(scores, torch.ones_like(scores))

    @staticmethod
    def discriminator_loss(module: GAN, batch: Any) -> Tensor:
        (x,) = batch
        real, fake = module.discriminator(x), module.discriminator(module._fake(x).detach())
        return F.binary_cross_entropy_with_logits(real, torch.ones_like(real)) + F.binary_cross_entropy_with_logits(
            fake, torch.zeros_like(fake)
        )

    def training_step(self, batch: Any, batch_idx: int) -> None:
        g_opt, d_opt = self.optimizers()  # type: ignore[misc]
        for optimizer, loss_fn in ((d_opt, self.discriminator_loss), (g_opt, self.generator_loss)):
            loss = loss_fn(self, batch)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.generator.parameters(), lr=1e-3),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3),
        ]


class Diffusion(_Module):
    """A denoiser trained DDPM-style: random timesteps, ``torch.randn_like`` noise, the noise as the target."""

    def __init__(self) -> None:
        super().__init__()
        self.time = nn.Embedding(50, 16)
        self.net = nn.Sequential(nn.Linear(12 + 16, 32), nn.SiLU(), nn.Linear(32, 12))
        self.register_buffer("alphas", torch.cumprod(1 - torch.linspace(1e-4, 0.02, 50), 0))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (x,) = batch
        t = torch.randint(0, 50, (x.shape[0],), device=x.device)
        noise = torch.randn_like(x)
        alpha = self.alphas[t].unsqueeze(-1)
        noisy = alpha.sqrt() * x + (1 - alpha).sqrt() * noise
        return F.mse_loss(self.net(torch.cat([noisy, self.time(t)], dim=-1)), noise)


class StockSurrogates(_Module):
    """``spectral_norm`` (new and old style), ``weight_norm``, an embedding with ``padding_idx``, in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16, padding_idx=0)
        self.spectral = parametrizations.spectral_norm(nn.Linear(16, 16))
        self.spectral_old = nn.utils.spectral_norm(nn.Linear(16, 16))
        self.weight_normed = parametrizations.weight_norm(nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, labels = batch
        tokens = tokens.clone()
        tokens[:, -4:] = 0  # padded
        h = self.embed(tokens).mean(1)
        h = torch.tanh(self.spectral_old(torch.tanh(self.spectral(h))))
        return F.cross_entropy(self.weight_normed(h), labels)


def fake_quantise(weight: Tensor, scale: float = 0.05) -> Tensor:
    """Round to a grid in the forward, the identity in the backward: a straight-through estimator."""
    return weight + (torch.round(weight / scale) * scale - weight).detach()


class FakeQuantised(_Module):
    """A quantisation-aware-training layer: its weight fake-quantised with a straight-through estimator."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.Tanh())
        self.quantised = nn.Linear(32, 32)
        self.head = nn.Linear(32, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (x,) = batch
        h = torch.tanh(F.linear(self.body(x), fake_quantise(self.quantised.weight), self.quantised.bias))
        return self.head(h).square().mean()


@dataclass(frozen=True)
class RealModel:
    """One model of the matrix: how to build it, its data, and the callbacks that check it.

    Attributes:
        name: As in tables.
        module: Builds the LightningModule (seeded by the caller).
        loader: Its synthetic data.
        watches: The GradWatch callbacks the README gives for it (default settings but what the model needs).
        needs: A package the model needs (``None``: none beyond the test extras' core).
    """

    name: str
    module: Callable[[], pl.LightningModule]
    loader: Callable[[], DataLoader]
    watches: Callable[..., list[GradWatch]] = lambda **options: [GradWatch(**options)]
    needs: str | None = None


def _gan_watches(**options: Any) -> list[GradWatch]:
    # each optimizer's loss on its own: the discriminator's loss detaches the generator's output, so the generator's
    # parameters get no gradient from it by design
    return [
        GradWatch(loss_fn=GAN.generator_loss, **options),
        GradWatch(loss_fn=GAN.discriminator_loss, ignore=["generator.*"], **options),
    ]


CORRECT = (
    RealModel("Hugging Face GPT-2", lambda: CausalLM("gpt2"), _token_loader, needs="transformers"),
    RealModel("Hugging Face Llama", lambda: CausalLM("llama"), _token_loader, needs="transformers"),
    RealModel("Hugging Face BERT", Bert, _token_loader, needs="transformers"),
    RealModel("peft LoRA on Llama", lambda: CausalLM("llama", lora=True), _token_loader, needs="peft"),
    RealModel("VAE (randn_like)", VAE, lambda: _vector_loader(12)),
    RealModel("GAN (randn(dtype=x.dtype), per-optimizer loss_fn)", GAN, lambda: _vector_loader(8), _gan_watches),
    RealModel("diffusion noising step", Diffusion, lambda: _vector_loader(12)),
    RealModel("spectral_norm, weight_norm, padding_idx", StockSurrogates, _token_loader),
    RealModel(
        "straight-through fake quantiser, ignore=",
        FakeQuantised,
        lambda: _vector_loader(12),
        lambda **options: [GradWatch(ignore=["quantised.weight"], **options)],
    ),
    RealModel("straight-through fake quantiser", FakeQuantised, lambda: _vector_loader(12)),
)
"""The correct models: no check may fail."""

BUGGY = (
    RealModel(
        "peft LoRA on Llama, adapter backward 2% off",
        lambda: CausalLM("llama", lora=True, lora_bug=1.02),
        _token_loader,
        needs="peft",
    ),
    RealModel("VAE, decoder backward 2% off", lambda: VAE(decoder_bug=1.02), lambda: _vector_loader(12)),
)
"""Models with a planted bug: the first check must fail."""


def fit(model: RealModel, steps: int = 3, seed: int = 0, **options: Any) -> tuple[pl.LightningModule, list[GradWatch]]:
    """Fit ``model`` for ``steps`` optimizer steps with its GradWatch callbacks (``options`` added to each)."""
    pl.seed_everything(seed, verbose=False)
    module = model.module()
    watches = model.watches(**options)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        callbacks=watches,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, model.loader())
    return module, watches
