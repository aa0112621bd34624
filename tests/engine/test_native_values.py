"""A pure-float16 model's own forward values replayed into its float64 evaluation (``engine/function/
native_values.py``): the draw of the noise floor where a 16-bit kernel that rounds inside moves a ReLU's kink, which
the emulated rounding does not reproduce (a false alarm on a correct float16 CNN before)."""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from low_precision_models import classifier_loss, image_batches, sixteen_bit_classifier

from gradwatch import check_gradients
from gradwatch.engine.function.native_values import NativeValues


def _trained_cnn(factor: float = 1.0) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    """The float16 CNN of ``benchmarks/low_precision.py`` (seed 0) trained up to the first of its batches where its
    float16 BatchNorm returns ReLU inputs that are positive in float64 as negative (``bn2.bias``'s correct float16
    gradient more than 1% off the exact one; which step that is depends on the CPU's float16 kernels), and that batch;
    with ``factor``, the same point of the model whose 16-bit kernel is wrong by it."""
    step = _kinked_step()
    model = sixteen_bit_classifier("cnn", torch.float16, factor, seed=0)
    batches = image_batches("cnn", torch.float16, step + 1, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    for batch in batches[:step]:
        optimizer.zero_grad()
        classifier_loss(model, batch).backward()
        optimizer.step()
    return model, batches[step]


@functools.cache
def _kinked_step(most: int = 12) -> int:
    model = sixteen_bit_classifier("cnn", torch.float16, 1.0, seed=0)
    batches = image_batches("cnn", torch.float16, most, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    for step, batch in enumerate(batches):
        native = _gradients(model, batch)["bn2.bias"]
        precise = _gradients(copy.deepcopy(model).double(), (batch[0].double(), batch[1]))["bn2.bias"]
        if _relative(native, precise) > 1e-2:
            return step
        optimizer.zero_grad()
        classifier_loss(model, batch).backward()
        optimizer.step()
    raise AssertionError(f"no kink moved by the float16 BatchNorm in {most} steps of the CNN on this CPU")


def _gradients(model: nn.Module, batch: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
    model.zero_grad()
    classifier_loss(model, batch).backward()
    return {name: p.grad.double().clone() for name, p in model.named_parameters() if p.grad is not None}


def _relative(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_the_replayed_float64_gradient_has_the_native_forwards_kinks() -> None:
    model, batch = _trained_cnn()
    native = _gradients(model, batch)
    precise_model = copy.deepcopy(model).double()
    precise_batch = (batch[0].double(), batch[1])
    precise = _gradients(precise_model, precise_batch)
    values = NativeValues(model)
    with values.recording():
        _gradients(model, batch)
    values.model = precise_model  # the same modules, by position: a copy records under other ids
    pairs = zip(model.modules(), precise_model.modules(), strict=True)
    values.outputs = {id(b): values.outputs[id(a)] for a, b in pairs if id(a) in values.outputs}
    with values.replayed():
        replayed = _gradients(precise_model, precise_batch)
    # the correct float16 gradient is 1.3% off the exact one at this point, and the replay reproduces that
    assert _relative(native["bn2.bias"], precise["bn2.bias"]) > 1e-2
    assert _relative(replayed["bn2.bias"], precise["bn2.bias"]) > 1e-2
    assert _relative(native["bn2.bias"], replayed["bn2.bias"]) < 1e-3
    assert values.unreplayed == set()
    assert all(not m._forward_hooks for m in precise_model.modules())
    assert all(not m._forward_hooks for m in model.modules())


class _WrongInSixteenBits(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 1.05 if x.dtype == torch.float16 else x


def test_a_forward_wrong_in_sixteen_bits_is_not_replayed() -> None:
    model = nn.Sequential(nn.Linear(8, 8), _WrongInSixteenBits(), nn.Linear(8, 2)).half()
    x = torch.randn(4, 8).half()
    values = NativeValues(model)
    with values.recording(), torch.no_grad():
        model(x)
    model.double()
    with values.replayed(), torch.no_grad():
        model(x.double())
    # the wrong module, and the one its wrong values reach; the first linear layer is replayed
    assert values.unreplayed == {"1", "2"}


def test_a_correct_float16_cnn_whose_kernel_moves_a_kink_is_not_failed() -> None:
    model, batch = _trained_cnn()
    report = check_gradients(model, batch, classifier_loss, step=_kinked_step(), rotation=2)
    assert report.verdict == "ok", str(report)
    assert all(not m._forward_hooks for m in model.modules())


def test_a_five_percent_float16_kernel_bug_still_fails_there() -> None:
    model, batch = _trained_cnn(factor=1.05)
    report = check_gradients(model, batch, classifier_loss, step=_kinked_step(), rotation=2)
    assert report.verdict == "fail", str(report)


def test_a_check_says_which_modules_forward_is_not_rounding() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), _WrongInSixteenBits(), nn.Linear(16, 4)).half()
    batch = (torch.randn(16, 8).half(), torch.randint(0, 4, (16,)))
    report = check_gradients(model, batch, classifier_loss)
    said = [str(note) for note in report.notes if "differs from the float64 one" in str(note)]
    assert len(said) == 1, [str(note) for note in report.notes]
    assert "`2`, `3`" in said[0]


def test_an_output_changed_in_place_downstream_is_replayed_as_computed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(inplace=True), nn.Linear(16, 4)).half()
    batch = (torch.randn(16, 8).half(), torch.randint(0, 4, (16,)))
    report = check_gradients(model, batch, classifier_loss)
    assert report.verdict == "ok", str(report)
    assert not [str(note) for note in report.notes if "differs from the float64 one" in str(note)]


class _FloatSinusoid(nn.Module):
    """A sinusoidal embedding computed in float32 inside a float16 model, of arguments near 1000 (as diffusers'
    ``Timesteps``): float32's sine there is ~1e-4 off float64's, far beyond 4 units of float32, with no bug."""

    def forward(self, t: Tensor) -> Tensor:
        frequencies = torch.linspace(0.5, 1.0, 8, dtype=torch.float32, device=t.device)
        return torch.sin(900 * t.float()[:, :1] * frequencies)


class _TimeConditioned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.time = _FloatSinusoid()
        self.mix = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.mix(torch.cat([x, self.time(x).to(x.dtype)], dim=1))


def test_a_float32_computation_inside_a_float16_model_is_left_to_float64_without_a_note() -> None:
    torch.manual_seed(0)
    model = _TimeConditioned().half()
    batch = (torch.rand(16, 8).half() + 1, torch.randint(0, 4, (16,)))
    report = check_gradients(model, batch, classifier_loss)
    assert report.verdict == "ok", str(report)
    assert not [str(note) for note in report.notes if "differs from the float64 one" in str(note)]
