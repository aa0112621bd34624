"""The Hugging Face stack as people run it, made tiny: a word-level tokenizer built on the spot, a randomly initialised
Llama from a config, synthetic token datasets (prompts and a reward for GRPO), and the backward bugs planted in it (a
3% RMSNorm input gradient, a 3% MLP activation input gradient, a 3% error in a custom LoRA variant's hand-written
backward, a 3% error inside a PEFT DoRA module's forward). Nothing is downloaded. Used by
``tests/integrations/test_trl.py``, ``tests/integrations/test_hf_stack.py``, ``benchmarks/huggingface.py`` and
``benchmarks/dora_culprits.py``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

VOCAB = 64
BUG = 1.03
"""The planted bugs: one input gradient 3% too large."""


def tiny_tokenizer() -> Any:
    """A word-level tokenizer over ``t0 … t63`` (``t1`` end of sequence, ``t2`` padding), built without any file."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="t1", pad_token="t2", unk_token="t0"
    )


def tiny_llama(dtype: torch.dtype | None = None, layers: int = 2, seed: int = 0) -> nn.Module:
    """A randomly initialised ``LlamaForCausalLM`` (hidden 32, 4 heads, vocabulary 64), seeded, in ``dtype``."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        pad_token_id=2,
        eos_token_id=1,
        bos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config)
    return model if dtype is None else model.to(dtype)


def token_ids(count: int = 48, length: int = 12, seed: int = 3) -> list[list[int]]:
    """Synthetic token sequences (no padding, no end-of-sequence token inside)."""
    return torch.randint(3, VOCAB, (count, length), generator=torch.Generator().manual_seed(seed)).tolist()


def language_modeling_dataset(count: int = 48, length: int = 12) -> Any:
    """A ``datasets.Dataset`` of tokenised sequences, as TRL's ``SFTTrainer`` takes them (``input_ids`` only)."""
    import datasets

    return datasets.Dataset.from_dict({"input_ids": token_ids(count, length)})


class Tokens(torch.utils.data.Dataset):
    """Synthetic token sequences, their own labels, for a plain ``transformers.Trainer``."""

    def __init__(self, count: int = 48, length: int = 12) -> None:
        self.ids = torch.tensor(token_ids(count, length))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class ScaledRMSNorm(torch.autograd.Function):
    """Llama's RMSNorm (normalised in float32 whatever the input's dtype, as ``LlamaRMSNorm`` does) with a hand-written
    backward whose input gradient is multiplied by ``factor`` (1 is correct): a fused norm kernel's bug."""

    generate_vmap_rule = True

    @staticmethod
    def forward(hidden: Tensor, weight: Tensor, eps: float, factor: float) -> Tensor:  # type: ignore[override]
        h = hidden.to(torch.float32)
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(hidden.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:  # type: ignore[override]
        hidden, weight, ctx.eps, ctx.factor = inputs
        ctx.save_for_backward(hidden, weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight = ctx.saved_tensors
        h = hidden.to(torch.float32)
        rms = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + ctx.eps)
        normed = h * rms
        grad_weight = (grad * normed.to(hidden.dtype)).reshape(-1, grad.shape[-1]).sum(0)
        grad_normed = (grad * weight).to(torch.float32)
        grad_hidden = rms * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        return (grad_hidden * ctx.factor).to(hidden.dtype), grad_weight.to(weight.dtype), None, None


def plant_norm_bug(norm: nn.Module, factor: float = BUG) -> None:
    """Replace the forward of one ``LlamaRMSNorm`` with :class:`ScaledRMSNorm` (its input gradient ``factor`` off)."""

    def forward(hidden_states: Tensor) -> Tensor:
        return ScaledRMSNorm.apply(hidden_states, norm.weight, norm.variance_epsilon, factor)

    norm.forward = forward  # type: ignore[method-assign]


class ScaledSiLU(torch.autograd.Function):
    """``silu`` whose backward multiplies the input gradient by ``factor``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        return torch.nn.functional.silu(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:  # type: ignore[override]
        x, ctx.factor = inputs
        ctx.save_for_backward(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        sigmoid = torch.sigmoid(x)
        return grad * sigmoid * (1 + x * (1 - sigmoid)) * ctx.factor, None


class BuggySiLU(nn.Module):
    """An MLP activation module (``act_fn``) whose backward is ``factor`` off."""

    def __init__(self, factor: float = BUG) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return ScaledSiLU.apply(x, self.factor)


def plant_activation_bug(model: nn.Module, layer: int, factor: float = BUG) -> str:
    """Give the MLP of decoder layer ``layer`` an activation whose input gradient is ``factor`` off; its name."""
    mlp = model.get_submodule(f"model.layers.{layer}.mlp")
    mlp.act_fn = BuggySiLU(factor)
    return f"model.layers.{layer}.mlp.act_fn"


class LowRankUpdate(torch.autograd.Function):
    """A LoRA layer's output, ``x W^T + s (x A^T) B^T`` (``W`` frozen, ``None`` for the update alone), with a
    hand-written backward (a fused LoRA kernel's) whose input gradient (``where="input"``) or ``A`` gradient
    (``where="weight"``) is multiplied by ``factor`` (1 is correct)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        x: Tensor, base: Tensor | None, a: Tensor, b: Tensor, scaling: float, factor: float, where: str
    ) -> Tensor:
        update = (x @ a.T @ b.T) * scaling
        return update if base is None else x @ base.T + update

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:  # type: ignore[override]
        x, base, a, b, ctx.scaling, ctx.factor, ctx.where = inputs
        ctx.has_base = base is not None
        ctx.save_for_backward(x, base if base is not None else a, a, b)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, base, a, b = ctx.saved_tensors
        scaled = grad * ctx.scaling
        through_b = scaled @ b  # the gradient at x A^T
        grad_x = through_b @ a + (grad @ base if ctx.has_base else 0)
        grad_a = through_b.reshape(-1, a.shape[0]).T @ x.reshape(-1, x.shape[-1])
        grad_b = scaled.reshape(-1, b.shape[0]).T @ (x @ a.T).reshape(-1, a.shape[0])
        if ctx.where == "input":
            grad_x = grad_x * ctx.factor
        else:
            grad_a = grad_a * ctx.factor
        return grad_x, None, grad_a, grad_b, None, None, None


def plant_lora_variant_bug(model: nn.Module, name: str, where: str, fused: bool, factor: float = BUG) -> None:
    """Run every PEFT ``lora.Linear`` of ``model`` through :class:`LowRankUpdate`, reading its adapter's weights
    directly (the ``lora_A``/``lora_B`` modules are never called), with ``factor`` planted at the layer ``name``.

    ``fused=False``: a ``LoraVariant`` (PEFT's extension point, as DoRA is one) whose ``forward`` adds the update to the
    base layer's output; ``fused=True``: the layer's ``forward`` replaced by one kernel that computes the base layer and
    the update together (the base layer is not called either)."""
    from peft.tuners.lora.layer import Linear, LoraVariant

    class Variant(LoraVariant):
        def __init__(self, factor: float) -> None:
            self.factor = factor

        @staticmethod
        def init(module: Any, adapter_name: str, **kwargs: Any) -> None:
            pass

        def forward(  # type: ignore[override]
            self, module: Any, active_adapter: str, x: Tensor, result: Tensor, **kwargs: Any
        ) -> Tensor:
            a, b = module.lora_A[active_adapter].weight, module.lora_B[active_adapter].weight
            dropped = module.lora_dropout[active_adapter](x)
            return result + LowRankUpdate.apply(dropped, None, a, b, module.scaling[active_adapter], self.factor, where)

    def fused_forward(layer: Any, layer_factor: float) -> Any:
        def forward(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            base = layer.base_layer.weight
            return LowRankUpdate.apply(x, base, a, b, layer.scaling["default"], layer_factor, where)

        return forward

    for module_name, module in model.named_modules():
        if isinstance(module, Linear):
            layer_factor = factor if module_name == name else 1.0
            if fused:
                module.forward = fused_forward(module, layer_factor)
            else:
                module.lora_variant["default"] = Variant(layer_factor)


class ScaledGradient(torch.autograd.Function):
    """The identity, whose backward scales the gradient by ``factor``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, float], output: Tensor) -> None:  # type: ignore[override]
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.factor, None


def plant_dora_bug(dora: nn.Module, where: str, factor: float = BUG) -> None:
    """Put a :class:`ScaledGradient` in the ``forward`` of PEFT's ``DoraLinearLayer`` ``dora``: on its input ``x``
    (``"input"``: the gradient its LoRA path gives ``x``), on the output of its call of ``lora_B``
    (``"lora_output"``: inside its own code, between the adapters and the result), on its result (``"output"``) or on
    the base layer's output it rescales (``"base_result"``)."""
    original = dora.forward

    def forward(x: Tensor, **kwargs: Any) -> Tensor:
        if where == "input":
            x = ScaledGradient.apply(x, factor)
        if where == "base_result":
            kwargs["base_result"] = ScaledGradient.apply(kwargs["base_result"], factor)
        if where == "lora_output":
            adapter = kwargs["lora_B"]

            def scaled(h: Tensor) -> Tensor:
                # the call on the input, not the one on ``torch.eye`` that makes the weight for the norm
                out = adapter(h)
                return ScaledGradient.apply(out, factor) if h.dim() > 2 else out

            kwargs["lora_B"] = scaled
        result = original(x, **kwargs)
        return ScaledGradient.apply(result, factor) if where == "output" else result

    dora.forward = forward  # type: ignore[method-assign]


def preference_dataset(count: int = 32, seed: int = 5) -> Any:
    """A ``datasets.Dataset`` of preference triples (``prompt``, ``chosen``, ``rejected``) in the tokenizer's words."""
    import datasets

    generator = torch.Generator().manual_seed(seed)

    def text(length: int) -> str:
        return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (length,), generator=generator))

    rows = [(text(6), text(5), text(5)) for _ in range(count)]
    return datasets.Dataset.from_dict(
        {key: [row[i] for row in rows] for i, key in enumerate(("prompt", "chosen", "rejected"))}
    )


def prompt_dataset(count: int = 32, length: int = 5, seed: int = 7) -> Any:
    """A ``datasets.Dataset`` of prompts (``prompt``) in the tokenizer's words, as TRL's ``GRPOTrainer`` takes them."""
    import datasets

    generator = torch.Generator().manual_seed(seed)
    prompts = [
        " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (length,), generator=generator)) for _ in range(count)
    ]
    return datasets.Dataset.from_dict({"prompt": prompts})


def low_token_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """A reward for GRPO: the share of a completion's tokens among ``t3 … t19`` (it varies within a group)."""
    low = {f"t{i}" for i in range(3, 20)}
    return [sum(word in low for word in text.split()) / max(1, len(text.split())) for text in completions]
