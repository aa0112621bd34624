"""A loss that all-reduces with a plain ``torch.distributed.all_reduce`` (ms-swift #9778), checked on each of two
processes (CPU, gloo); each rank writes what :func:`check_gradients` said to ``OUT_DIR/<scenario>_rank<r>.json``.

Usage: ``torchrun``-style, one process per rank (``tests/engine/test_torch_warnings.py`` runs it through
``two_processes.run_launched``). Every rank holds the same model and batch, so each check's evaluations, and the
collectives in them, run in lockstep. ``all_reduce``: the loss summed over the ranks through ``c10d::allreduce_``,
which has no autograd kernel, so the gradient is this rank's alone, half the derivative of the loss it returns;
``autograd_all_reduce``: the same through ``torch.distributed.nn.all_reduce``, whose backward sums too (right).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn
import torch.nn.functional as F
from public_bug_models import regression_batch, regression_mlp
from torch import Tensor, nn
from two_processes import serve_scenarios

from gradwatch import check_gradients
from gradwatch.engine.results.notes import NoteCode


def plain(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    loss = F.mse_loss(model(batch[0]), batch[1])
    dist.all_reduce(loss)
    return loss


def autograd(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return dist_nn.all_reduce(F.mse_loss(model(batch[0]), batch[1]))


def run(scenario: str) -> dict[str, Any]:
    loss_fn = {"all_reduce": plain, "autograd_all_reduce": autograd}[scenario]
    model, batch = regression_mlp(), regression_batch()
    loss_fn(model, batch).backward()  # training's own step first: PyTorch shows its warning here, once
    model.zero_grad()
    report = check_gradients(model, batch, loss_fn, vectorize=False)
    return {
        "rank": dist.get_rank(),
        "verdict": str(report.verdict),
        "descent_ratio": report.descent_ratio,
        "silently_incorrect": [str(n) for n in report.noted(NoteCode.SILENTLY_INCORRECT)],
        "report": str(report),
    }


if __name__ == "__main__":
    torch.manual_seed(0)
    serve_scenarios(run)
