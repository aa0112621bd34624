"""Float64 probes evaluate the model's own function: casts down inside the model and random draws in its dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradwatch import check_gradients
from gradwatch.engine.function.fidelity import Float64Fidelity
from gradwatch.engine.notes import NoteCode, codes


def test_casts_down_stay_float64() -> None:
    x = torch.randn(3, 4, dtype=torch.float64)
    other = torch.ones(1)
    with Float64Fidelity(torch.float32) as fidelity:
        results = [
            x.float(),
            x.half(),
            x.to(torch.float32),
            x.to("cpu", torch.float32),
            x.to(dtype=torch.bfloat16),
            x.to(other),
            x.type(torch.float32),
            F.softmax(x, dim=-1, dtype=torch.float32),
            x.sum(dtype=torch.float32),
            torch.zeros(2, dtype=torch.float32),  # a buffer the float64 computation may be written into
        ]
    assert all(r.dtype == torch.float64 for r in results), [r.dtype for r in results]
    assert fidelity.acted == {"casts"}
    assert torch.equal(results[0], x)


def test_factories_without_a_dtype_make_float64_with_the_training_values() -> None:
    with Float64Fidelity(torch.float32) as fidelity:
        mask = torch.full((3, 3), float("-inf")).triu(1)
        steps = torch.linspace(0, 1, 7)
        constant = torch.tensor([0.1, 0.2])
        positions = torch.arange(4)
    assert mask.dtype == steps.dtype == constant.dtype == torch.float64
    assert positions.dtype == torch.int64  # integer results are kept
    assert torch.equal(steps, torch.linspace(0, 1, 7).double())  # the float32 numbers, not float64 ones
    assert torch.equal(constant, torch.tensor([0.1, 0.2]).double())
    assert fidelity.acted == {"factories"}


def test_float32_tensors_and_integer_casts_are_untouched() -> None:
    x32 = torch.randn(3)
    x64 = x32.double()
    with Float64Fidelity(torch.float32) as fidelity:
        assert x32.double().dtype == torch.float64
        assert x32.half().dtype == torch.float16
        assert x64.long().dtype == torch.int64
        assert x64.to(torch.int32).dtype == torch.int32
    assert fidelity.acted == set()


def _draws(dtype: torch.dtype) -> list[Tensor]:
    like = torch.zeros(5, 3, dtype=dtype)
    torch.manual_seed(7)
    return [
        torch.randn(5, 3, dtype=dtype),
        torch.rand(2, dtype=dtype),
        torch.randn_like(like),
        torch.rand_like(like),
        torch.empty_like(like).normal_(),
        torch.empty_like(like).uniform_(-1, 1),
        torch.normal(like, 2.0),
    ]


def test_random_draws_are_the_native_numbers() -> None:
    native = [t.double() for t in _draws(torch.float32)]
    with Float64Fidelity(torch.float32) as fidelity:
        faithful = _draws(torch.float64)
    assert fidelity.acted == {"random draws"}
    for got, want in zip(faithful, native, strict=True):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    plain = [t.double() for t in _draws(torch.float64)]
    assert not torch.equal(plain[0], native[0])  # without it, float64 draws are other numbers


class CastingHead(nn.Module):
    """The Hugging Face causal-LM habit: the loss on ``logits.float()``, the softmax upcast to float32."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        scores = h @ h.transpose(-1, -2)
        h = F.softmax(scores, dim=-1, dtype=torch.float32).to(h.dtype) @ h
        return self.head(torch.tanh(self.body(h)))


def _lm_loss(model: nn.Module, batch: Tensor) -> Tensor:
    logits = model(batch[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def test_a_loss_cast_to_float32_is_probed_in_float64() -> None:
    batch = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(1))
    report = check_gradients(CastingHead(), batch, _lm_loss)
    assert report.verdict == "ok", report.summary()
    assert report.count("inconclusive") == 0, report.summary()
    assert report.noted(NoteCode.FLOAT64_CASTS_KEPT), report.notes


class VAE(nn.Module):
    def __init__(self, decoder_bug: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(12, 2 * 4)
        self.decoder = nn.Linear(4, 12)
        self.decoder_bug = decoder_bug

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        mu, log_var = self.encoder(x).chunk(2, dim=-1)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * log_var)
        if self.decoder_bug != 1.0:
            z = _ScaleBackward.apply(z, self.decoder_bug)
        return self.decoder(z), mu, log_var


class _ScaleBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:  # type: ignore[no-untyped-def]
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[no-untyped-def]
        return grad * ctx.factor, None


def _vae_loss(model: nn.Module, x: Tensor) -> Tensor:
    recon, mu, log_var = model(x)
    kl = -0.5 * torch.mean(1 + log_var - mu.square() - log_var.exp())
    return F.mse_loss(recon, x) + kl


def test_a_vae_drawing_randn_like_is_conclusive_and_a_decoder_bug_is_caught() -> None:
    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(3))
    healthy = check_gradients(VAE(), x, _vae_loss)
    assert healthy.verdict == "ok", healthy.summary()
    assert healthy.count("inconclusive") == 0, healthy.summary()
    assert healthy.noted(NoteCode.FLOAT64_DRAWS_NATIVE), healthy.notes
    buggy = check_gradients(VAE(decoder_bug=1.02), x, _vae_loss)
    assert buggy.verdict == "fail", buggy.summary()
    failing = {p.target for p in buggy.failures}
    assert "encoder.weight" in failing, str(buggy)
    assert not any(t.startswith("decoder.") for t in failing), str(buggy)


def test_a_latent_drawn_in_the_input_dtype_is_the_training_latent() -> None:
    torch.manual_seed(0)
    generator_net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))

    def loss(model: nn.Module, x: Tensor) -> Tensor:
        latent = torch.randn(x.shape[0], 6, dtype=x.dtype, device=x.device)
        return (model(latent) - x).square().mean()

    report = check_gradients(generator_net, torch.randn(8, 8), loss)
    assert report.verdict == "ok", report.summary()
    assert report.count("inconclusive") == 0, report.summary()


def test_a_model_that_needs_nothing_keeps_no_fidelity_note() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
    report = check_gradients(model, torch.randn(6, 5), lambda m, x: m(x).square().mean())
    assert report.verdict == "ok"
    assert not {NoteCode.FLOAT64_CASTS_KEPT, NoteCode.FLOAT64_DRAWS_NATIVE} & set(codes(report.notes))


def test_fractional_max_pool_samples_its_regions_as_training_does() -> None:
    # F.fractional_max_pool2d draws its pooling regions with torch.rand(..., dtype=input.dtype)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.FractionalMaxPool2d(2, output_ratio=0.5), nn.Flatten(), nn.LazyLinear(3)
    )
    images = torch.randn(4, 1, 12, 12, generator=torch.Generator().manual_seed(1))
    model(images)  # materialise the lazy layer
    report = check_gradients(model, images, lambda m, x: m(x).square().mean())
    assert report.verdict == "ok", str(report)
    assert report.precision == "float64"


def test_an_out_buffer_made_float64_takes_float32_inputs_in_its_precision() -> None:
    # TRL's chunked log-prob kernel: torch.empty(..., dtype=float32) as the out= buffer of torch.mm, its inputs from a
    # float32 model beside the float64 one (DPO's frozen reference model)
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    fidelity = Float64Fidelity(torch.float32)
    with fidelity:
        buffer = torch.empty((3, 2), dtype=torch.float32)
        torch.mm(a, b, out=buffer)
    assert buffer.dtype == torch.float64
    assert torch.equal(buffer, a.double() @ b.double())
    assert "casts" in fidelity.acted
