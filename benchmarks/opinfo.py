"""gradwatch on PyTorch's own operators: the OpInfo database, float32, correct backwards and injected bugs.

PyTorch's operator database (``torch.testing._internal.common_methods_invocations.op_db``) lists, for every operator,
the sample inputs its own gradient tests use. For every operator that supports autograd in float32 on the CPU, and for
its first samples, the floating inputs become parameters of a module and the loss is the sum of its floating outputs
weighted by fixed random weights. ``check_gradients`` checks it at GradWatch's defaults:

* **correct**: the operator as it is; a ``fail`` is a false alarm, an ``inconclusive`` check a check that told
  nothing. Operators whose gradient PyTorch's own gradient test skips (``normal``: its gradient is deliberately not
  the derivative; ``as_strided_scatter`` on overlapping memory) are left out, and the outputs checked are those that
  test differentiates (``output_process_fn_grad``);
* **bugs**: the same with a wrong backward injected after the operator (its outputs' gradient scaled by ``1 + r``), for
  the operators whose correct check was ``ok``; a check that does not fail missed the bug.

Needs ``expecttest`` (``pip install -c constraints.txt expecttest``). Run: ``python benchmarks/opinfo.py`` (a few
minutes on 2 CPU cores; ``--quick`` checks the first 60 operators).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import time
import warnings
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from gradwatch import CheckReport, GradWatch, check_gradients

DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(GradWatch).parameters.items()
    if name in ("tensor_probes", "random_probes", "param_probes", "input_probes", "precision", "vectorize")
}
"""The probes of ``GradWatch()`` (the operators' inputs are parameters here: there is no batch to slice)."""

SAMPLES = 3
"""Samples checked per operator."""


class ScaleGradient(torch.autograd.Function):
    """The identity, whose backward scales the gradient by ``factor``: a wrong backward, injected."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, float], output: Tensor) -> None:  # type: ignore[override]
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.factor, None


class Operator(nn.Module):
    """One operator on one sample, its differentiable floating inputs as parameters; ``factor`` != 1 injects a wrong
    backward after it."""

    def __init__(self, op: Any, sample: Any, factor: float = 1.0) -> None:
        super().__init__()
        self.op = op
        self.factor = factor
        self.output_process_fn_grad = sample.output_process_fn_grad
        leaves, self.spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        self.constants = []
        self.positions: list[int] = []
        parameters = []
        for position, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor) and leaf.is_floating_point() and leaf.requires_grad:
                parameters.append(nn.Parameter(leaf.detach().clone()))
                self.positions.append(position)
            self.constants.append(leaf.detach() if isinstance(leaf, Tensor) else leaf)
        self.inputs = nn.ParameterList(parameters)
        # the outputs autograd differentiates (others, such as a layer norm's mean, are constants to it by design)
        self.differentiable: list[int] | None = None
        with torch.enable_grad():
            self.differentiable = [i for i, out in enumerate(self._outputs()) if out.requires_grad]
        generator = torch.Generator().manual_seed(0)
        self.weights = [torch.randn(out.shape, generator=generator, dtype=out.dtype) for out in self._outputs()]

    def _outputs(self) -> list[Tensor]:
        leaves = list(self.constants)
        for position, parameter in zip(self.positions, self.inputs, strict=True):
            leaves[position] = parameter
        sample_input, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        # the op's own gradcheck wrapper (it symmetrises the input of cholesky & co., whose gradient assumes it)
        output = self.op.gradcheck_wrapper(self.op.get_op(), sample_input, *args, **kwargs)
        # the outputs PyTorch's own gradient tests differentiate (not a batch norm's saved statistics, say)
        outputs = pytree.tree_leaves(self.output_process_fn_grad(output))
        floating = [out for out in outputs if isinstance(out, Tensor) and out.is_floating_point()]
        if self.differentiable is not None:
            floating = [floating[i] for i in self.differentiable]
        return [ScaleGradient.apply(out, self.factor) if self.factor != 1.0 else out for out in floating]

    def forward(self) -> Tensor:
        return sum(((out * w).sum() for out, w in zip(self._outputs(), self.weights, strict=True)), torch.zeros(()))


def _loss(model: nn.Module, batch: Any) -> Tensor:
    return model()


def _gradient_tested(op: Any) -> bool:
    """Whether PyTorch's own gradient test runs on the operator in float32 on the CPU (it skips, or expects to fail,
    those whose gradient is deliberately not the derivative, as ``normal``'s, or not defined everywhere)."""
    return not any(
        decorator.is_active("TestBwdGradients", "test_fn_grad", "cpu", torch.float32, {})
        for decorator in op.decorators
        if hasattr(decorator, "is_active")  # DecorateInfo; plain decorators (precision overrides) apply to every test
    )


def _samples(op: Any) -> list[Any]:
    try:
        samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=True))
    except Exception:
        return []
    return samples[:SAMPLES]


def _check(op: Any, sample: Any, factor: float) -> CheckReport | None:
    try:
        module = Operator(op, sample, factor)
        if not list(module.parameters()) or not module.weights:
            return None
        return check_gradients(module, (), _loss, **DEFAULTS)
    except Exception:
        return None  # the operator does not run on this sample as wrapped (in-place outputs, views of inputs, ...)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the first 60 operators only")
    parser.add_argument("--error", type=float, default=0.01, help="the injected bug: gradients x (1 + ERROR)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [op for op in op_db if op.supports_autograd and torch.float32 in op.supported_dtypes("cpu")]
    ops = [op for op in ops if _gradient_tested(op)]
    if args.quick:
        ops = ops[:60]
    verdicts: collections.Counter[str] = collections.Counter()
    reasons: collections.Counter[str] = collections.Counter()
    false_alarms: list[str] = []
    nonfinite: list[str] = []
    inconclusive_ops: list[str] = []
    detected = missed = 0
    missed_ops: list[str] = []
    started = time.perf_counter()
    for op in ops:
        for sample in _samples(op):
            report = _check(op, sample, 1.0)
            if report is None:
                continue
            if any(p.kind == "loss" for p in report.probes):
                nonfinite.append(op.name)  # a sample whose loss is not finite: not a question of gradients
                continue
            verdicts[report.verdict] += 1
            if report.verdict == "fail":
                false_alarms.append(f"{op.name}: {report.failures[0].describe()}")
            if report.verdict == "inconclusive":
                inconclusive_ops.append(op.name)
                reasons.update({p.reason for p in report.probes if p.verdict == "inconclusive"} or {"no probe"})
            if report.verdict != "ok" or report.descent is None:
                continue  # a bug in a gradient that is exactly zero changes nothing
            buggy = _check(op, sample, 1.0 + args.error)
            if buggy is None:
                continue
            if buggy.verdict == "fail":
                detected += 1
            else:
                missed += 1
                missed_ops.append(f"{op.name} ({buggy.verdict})")
    checks = sum(verdicts.values())
    print(f"{len(ops)} operators, {checks} samples checked in {time.perf_counter() - started:.0f} s\n")
    print("| | samples | ok | inconclusive | fail |")
    print("|---|---|---|---|---|")
    print(
        f"| correct operators | {checks} | {verdicts['ok']} | {verdicts['inconclusive']} "
        f"({100 * verdicts['inconclusive'] / max(checks, 1):.1f}%) | {verdicts['fail']} |"
    )
    print(f"\n| injected bug (gradient x {1 + args.error:g}) | detected | missed |")
    print("|---|---|---|")
    print(f"| on the samples whose correct check was ok | {detected} | {missed} |")
    if nonfinite:
        print(f"\nleft out, their loss is not finite: {len(nonfinite)} samples ({', '.join(sorted(set(nonfinite)))})")
    if reasons:
        print(f"\ninconclusive probes' reasons: {dict(reasons.most_common())}")
        print(f"inconclusive operators: {', '.join(sorted(set(inconclusive_ops)))}")
    for line in false_alarms:
        print(f"FALSE ALARM {line}")
    if missed_ops:
        print(f"missed: {', '.join(missed_ops)}")


if __name__ == "__main__":
    main()
