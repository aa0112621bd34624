"""check_applied_gradient: planted faults on the training's path, each caught at the first check and attributed to
the right element, while the eager float32 recomputation (check_gradients) stays right; no false alarm on healthy
models in float32 and bf16 autocast, with and without accumulation; nothing of the run changes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from applied_models import (
    CNN,
    MLP,
    ChannelsLastPool,
    Transformer,
    batch_for,
    bf16,
    cross_entropy,
    scaled_once,
    train_window,
)
from helpers import assert_bit_identical, snapshot

from gradwatch import GradientCheckError, check_gradients
from gradwatch.engine.applied import AppliedWindow, check_applied_gradient
from gradwatch.engine.function import copies
from gradwatch.engine.report import UnrestoredStateWarning


def _eager_check_passes(model: torch.nn.Module, batch: object) -> bool:
    return check_gradients(model, batch, cross_entropy).verdict == "ok"


def test_a_backward_wrong_only_under_autocast_is_a_precision_fault() -> None:
    torch.manual_seed(0)
    model = MLP(autocast_fault=1.5)
    window = train_window(model, [batch_for(model, seed=1), batch_for(model, seed=2)], bf16)
    report = window.check(cross_entropy, path=bf16)
    assert report.scope == "applied"
    assert report.verdict == "fail"
    assert report.fault == "precision"
    assert {p.target for p in report.failures} >= {"fc1.weight", "fc1.bias"}
    assert "fc2.weight" not in {p.target for p in report.failures}  # before the faulty tanh: right
    assert report.floor_excess > 1
    assert _eager_check_passes(model, batch_for(model, seed=1))
    assert str(report).startswith("precision fault")


def test_gradients_not_zeroed_between_windows_are_an_accumulation_fault() -> None:
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_window(model, [batch_for(model, seed=1)])
    optimizer.step()
    window = train_window(model, [batch_for(model, seed=2)], zero=False)  # the loop forgot zero_grad
    report = window.check(cross_entropy)
    assert (report.verdict, report.fault) == ("fail", "accumulation")
    assert "already there when the window began" in report.fault_message
    assert _eager_check_passes(model, batch_for(model, seed=2))


def test_micro_batches_summed_where_the_loss_is_their_mean_is_an_accumulation_fault() -> None:
    torch.manual_seed(0)
    model = MLP()
    batches = [batch_for(model, seed=s) for s in (1, 2, 3)]
    model.zero_grad()
    window = AppliedWindow(model)
    for batch in batches:
        window.record(batch)
        cross_entropy(model, batch).backward()  # not divided by the window size
    assert window.check(cross_entropy, combine="sum").verdict == "ok"
    report = window.check(cross_entropy, combine="mean")
    assert (report.verdict, report.fault) == ("fail", "accumulation")
    assert "combination of the window's 3 micro-batch gradients" in report.fault_message


def test_a_gradient_corrupted_once_is_a_transient_fault() -> None:
    torch.manual_seed(0)
    model = MLP()
    with scaled_once(model.fc1.weight, 3.0):
        window = train_window(model, [batch_for(model, seed=1), batch_for(model, seed=2)])
        report = window.check(cross_entropy)
    assert (report.verdict, report.fault) == ("fail", "transient")
    assert [p.target for p in report.failures if p.kind == "tensor"] == ["fc1.weight"]


def test_a_hook_scaling_one_tensor_is_seen_by_both_checks_as_a_formula_fault() -> None:
    torch.manual_seed(0)
    model = MLP()
    handle = model.fc2.weight.register_hook(lambda grad: grad * 1.02)
    try:
        window = train_window(model, [batch_for(model, seed=1)])
        report = window.check(cross_entropy)
        recomputed = check_gradients(model, batch_for(model, seed=1), cross_entropy)
    finally:
        handle.remove()
    assert report.verdict == "fail"
    assert report.fault == "formula"
    assert [p.target for p in report.failures if p.kind == "tensor"] == ["fc2.weight"]
    assert recomputed.verdict == "fail"
    assert report.culprits[:1] == ["fc2"]
    with pytest.raises(GradientCheckError, match=r"^formula fault: applied gradient check failed at step 0"):
        raise GradientCheckError(report)


def test_a_backward_wrong_only_when_compiled_is_a_compiled_fault() -> None:
    """pytorch#197888: adaptive_max_pool3d on a channels-last-3d input at batch 16, compiled (about 15 s)."""
    torch.manual_seed(0)
    model = ChannelsLastPool()
    compiled = torch.compile(model)
    batches = [batch_for(model, seed=1)]
    window = train_window(model, batches, forward=compiled)
    report = check_applied_gradient(compiled, batches, cross_entropy, rng_states=window.rng_states)
    assert (report.verdict, report.fault) == ("fail", "compiled")
    assert [p.target for p in report.failures if p.kind == "tensor"] == ["_orig_mod.conv.weight"]
    assert _eager_check_passes(model, batches[0])


@pytest.mark.parametrize("accumulate", [1, 2], ids=["one-batch", "accumulation"])
@pytest.mark.parametrize("autocast", [False, True], ids=["32-true", "bf16-mixed"])
@pytest.mark.parametrize("model_class", [MLP, CNN, Transformer], ids=["mlp", "cnn-bn-dropout", "transformer-dropout"])
def test_healthy_models_pass_and_the_run_is_untouched(
    model_class: type[torch.nn.Module], autocast: bool, accumulate: int
) -> None:
    torch.manual_seed(0)
    model = model_class()
    path = bf16 if autocast else None
    window = train_window(model, [batch_for(model, seed=s) for s in range(1, accumulate + 1)], path)
    grads = [(p.grad, p.grad.clone()) for p in model.parameters()]
    before = snapshot(model)
    report = window.check(cross_entropy, path=path)
    assert_bit_identical(before, snapshot(model))
    assert all(
        p.grad is grad and torch.equal(grad, saved) for p, (grad, saved) in zip(model.parameters(), grads, strict=True)
    )
    assert report.verdict == "ok", str(report)
    assert report.fault is None
    assert 0 < report.floor_excess <= 1
    assert report.noise_floor > 0


def test_compiled_dropout_is_not_checked_rather_than_misjudged() -> None:
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model)
    batches = [batch_for(model, seed=1)]
    window = train_window(model, batches, forward=compiled)
    report = check_applied_gradient(compiled, batches, cross_entropy, rng_states=window.rng_states)
    assert report.verdict == "inconclusive"
    assert any("compiled code draws its own random numbers" in note for note in report.notes)


def test_arguments_are_validated() -> None:
    model = MLP()
    batch = batch_for(model)
    with pytest.raises(ValueError, match="`batches` must be a non-empty list"):
        check_applied_gradient(model, [], cross_entropy)
    with pytest.raises(ValueError, match="`combine` must be one of 'mean', 'sum' or a callable"):
        check_applied_gradient(model, [batch], cross_entropy, combine="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`rng_states` must have one entry per micro-batch \(1\); got 2"):
        check_applied_gradient(model, [batch], cross_entropy, rng_states=[None, None])
    with pytest.raises(ValueError, match="`gradients` must name trainable parameters"):
        check_applied_gradient(model, [batch], cross_entropy, {"nope": torch.zeros(1)})
    with pytest.raises(TypeError, match=r"`model` must be a torch\.nn\.Module"):
        check_applied_gradient("model", [batch], cross_entropy)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no micro-batch was recorded"):
        AppliedWindow(model).check(cross_entropy)


def test_stock_surrogates_and_ignored_tensors_are_checked_as_the_recomputed_check_checks_them() -> None:
    """Spectral norm (power iteration held constant), padding rows, and a straight-through estimator left out with
    ``ignore``: no false alarm."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 8, padding_idx=0)
            self.fc = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(8, 8))
            self.quant = torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.fc(self.embed(x).mean(1)))
            w = self.quant.weight
            w = w + (torch.round(w * 20) / 20 - w).detach()  # straight-through fake quantisation
            return torch.nn.functional.linear(h, w, self.quant.bias)

    model = Net()
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 10, (16, 5), generator=generator), torch.randint(0, 4, (16,), generator=generator))
    window = AppliedWindow(model)
    window.record(batch)
    cross_entropy(model, batch).backward()
    report = window.check(cross_entropy, ignore=["quant.weight"])
    assert report.verdict == "ok", str(report)
    assert "quant.weight" not in {p.target for p in report.probes}
    assert any(note.code == "spectral-norm" for note in report.notes)
    # without ignore=, the estimator is recognised by its signature, as the recomputed check recognises it
    unignored = window.check(cross_entropy)
    assert unignored.verdict != "fail"
    assert unignored.fault is None
    assert {p.target for p in unignored.probes if p.reason == "surrogate"} == {"*", "quant.weight"}
    assert any("quant.weight" in finding for finding in unignored.surrogates)


@pytest.mark.parametrize("autocast", [False, True], ids=["32-true", "bf16-mixed"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tiny_hugging_face_language_models_pass(family: str, autocast: bool) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        model = transformers.GPT2LMHeadModel(config)  # dropout 0.1 everywhere
    model.train()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (4, 16), generator=generator) for _ in range(2)]

    def lm_loss(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, labels=ids).loss

    path = bf16 if autocast else None
    window = AppliedWindow(model)
    for ids in batches:
        window.record(ids)
        with path() if path is not None else torch.autocast("cpu", enabled=False):
            loss = lm_loss(model, ids)
        (loss / len(batches)).backward()
    report = window.check(lm_loss, path=path)
    assert report.verdict == "ok", str(report)


@pytest.mark.parametrize(("model_class", "fault"), [(MLP, 1.0), (CNN, None), (Transformer, None), (MLP, 1.5)],
                         ids=["mlp", "cnn", "transformer", "mlp-autocast-fault"])  # fmt: skip
def test_float16_autocast_with_a_loss_scale_as_16_mixed_computes_it(
    model_class: type[torch.nn.Module], fault: float | None
) -> None:
    """16-mixed: float16 autocast, the loss scaled for backward and the gradient unscaled before the check."""
    torch.manual_seed(0)
    model = model_class(autocast_fault=fault) if fault is not None else model_class()  # type: ignore[call-arg]
    fp16 = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731
    scale = 2.0**12
    window = AppliedWindow(model)
    for seed in (1, 2):
        batch = batch_for(model, seed=seed)
        window.record(batch)
        with fp16():
            loss = cross_entropy(model, batch)
        (loss * scale / 2).backward()
    for param in model.parameters():
        param.grad /= scale  # what GradScaler.unscale_ does before on_before_optimizer_step
    report = window.check(cross_entropy, path=fp16, loss_scale=scale)
    expected = ("fail", "precision") if fault == 1.5 else ("ok", None)
    assert (report.verdict, report.fault) == expected, str(report)


def test_what_the_loss_changed_and_could_not_be_put_back_is_named_as_the_recomputed_check_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loss that scales a parameter in place (weight normalisation by hand) in a model too large to copy."""
    monkeypatch.setattr(copies, "PARAMETER_COPY_LIMIT", 0)
    torch.manual_seed(0)
    model = MLP()
    batches = [batch_for(model, seed=1)]
    window = train_window(model, batches)
    original = model.fc1.weight.detach().clone()

    def scaling(model: torch.nn.Module, batch: object) -> torch.Tensor:
        with torch.no_grad():
            model.fc1.weight.mul_(1.001)
        return cross_entropy(model, batch)

    with pytest.warns(UnrestoredStateWarning, match="fc1.weight"):
        report = window.check(scaling)
    assert report.unrestored == ("fc1.weight (its value before the check: no copy was kept)",)
    assert "fc1.weight" in report.side_effects
    assert any(note.code == "model-edited" for note in report.notes), report.notes
    assert torch.equal(model.fc1.weight.detach(), original * 1.001)  # the first edit only, not one per evaluation


def test_warnings_the_loss_raises_are_withheld_and_noted_as_the_recomputed_check_does() -> None:
    import warnings

    torch.manual_seed(0)
    model = MLP()
    window = train_window(model, [batch_for(model, seed=1)])

    def warning(model: torch.nn.Module, batch: object) -> torch.Tensor:
        warnings.warn("the loss warns at every call", UserWarning, stacklevel=1)
        return cross_entropy(model, batch)

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        report = window.check(warning)
    assert shown == []
    (note,) = report.noted("warnings-withheld")
    assert "UserWarning: the loss warns at every call" in note
    assert report.verdict == "ok", str(report)
    assert report.unrestored == ()


def test_a_loss_that_changes_a_parameter_itself_is_not_probed_rather_than_misjudged() -> None:
    """Weight normalisation by hand inside the loss: training differentiated at the parameter's value before the
    edit, while every evaluation of the check edits it again; the recomputed check leaves that tensor out, the applied
    check (whose gradient involves every tensor at training's point) makes no probe."""
    torch.manual_seed(0)
    model = MLP()

    def scaling(model: torch.nn.Module, batch: object) -> torch.Tensor:
        with torch.no_grad():
            model.fc1.weight.mul_(1.01)
        return cross_entropy(model, batch)

    batch = batch_for(model, seed=1)
    window = AppliedWindow(model)
    window.record(batch)
    scaling(model, batch).backward()
    report = window.check(scaling)
    assert report.verdict == "inconclusive", str(report)
    assert report.probes == []
    (note,) = report.noted("applied-edited")
    assert "fc1.weight" in note
    assert "fc1.weight" in report.side_effects
    assert report.unrestored == ()
    assert check_gradients(model, batch, scaling).verdict == "ok"  # fc1.weight left out there
