"""The update check (:mod:`gradwatch.engine.update`) on its own, without a watch: healthy optimizers pass 50 steps in
float32 and bfloat16, the planted faults of tests/update_models.py fail at the first check with their tensor named."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import update_models as models

from gradwatch.engine.update import UpdateSnapshot, check_update, update_tensors

Make = Callable[[torch.nn.Module], torch.optim.Optimizer]

HEALTHY: dict[str, Make] = {
    "sgd-momentum-nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                                                       weight_decay=1e-3),
    "sgd-dampening-maximize": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, dampening=0.1,
                                                        maximize=True),
    "sgd-plain-foreach": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, foreach=True),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=1e-2),
    "adam-foreach": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, foreach=True),
    "adam-fused": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, fused=True),
    "adamw-amsgrad": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, amsgrad=True),
    "adamw-fused-maximize": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, maximize=True),
    "rmsprop-centered-momentum": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.5, centered=True,
                                                               weight_decay=1e-3),
    "rmsprop-foreach": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, foreach=True),
    "adafactor": lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2, weight_decay=1e-3),
    "adafactor-foreach": lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2, foreach=True),
    "muon": lambda m: torch.optim.Muon([p for p in m.parameters() if p.ndim == 2], lr=0.02),
    "muon-match-rms": lambda m: torch.optim.Muon([p for p in m.parameters() if p.ndim == 2], lr=0.02,
                                                 adjust_lr_fn="match_rms_adamw", nesterov=False),
    "muon-keller": lambda m: models.KellerMuon([p for p in m.parameters() if p.ndim == 2], lr=0.02,
                                               weight_decay=0.01),
    "adagrad-replayed": lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-2),
}  # fmt: skip


def _train(
    make: Make, *, steps: int, dtype: torch.dtype = torch.float32, checked: Callable[[int], bool] = lambda s: True,
    scheduler: bool = False, max_norm: float | None = None, previous: bool = False,
) -> list:  # fmt: skip
    model = models.mlp(dtype)
    optimizer = make(model)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 10, 0.5) if scheduler else None
    reports, kept_previous = [], {}
    for step in range(1, steps + 1):
        models.loss_fn(model, models.batch(dtype)).backward()
        snapshot = None
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])))
        if checked(step):
            named = update_tensors(optimizer, list(model.named_parameters()), 3, step)
            snapshot = UpdateSnapshot.take(optimizer, named, norm=norm, max_norm=max_norm, previous=kept_previous)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        if snapshot is not None:
            reports.append(check_update(snapshot, step=step))
        if previous:
            kept_previous = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.zero_grad()
        if schedule is not None:
            schedule.step()
    return reports


@pytest.mark.parametrize("name", list(HEALTHY), ids=list(HEALTHY))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_healthy_optimizers_pass_fifty_steps(name: str, dtype: torch.dtype) -> None:
    reports = _train(HEALTHY[name], steps=50, dtype=dtype, scheduler=True)
    assert [r for r in reports if r.verdict == "fail"] == []
    assert all(r.scope == "update" for r in reports)
    undecided = [r for r in reports if r.verdict != "ok"]
    if dtype == torch.float32:
        assert len(undecided) <= 10, [str(r) for r in undecided][:2]
    # bfloat16 parameters round an update of lr 1e-3 to 5e-2 away in most elements: a check whose floor is a large
    # share of the update vouches for nothing, and says so instead of passing
    assert all(r.noted("update-unresolved") for r in undecided), [str(r) for r in undecided][:2]


def test_the_report_says_which_reference_it_used() -> None:
    adam = _train(HEALTHY["adamw-amsgrad"], steps=1)[0]
    assert "torch.optim.AdamW in float64" in adam.noted("update-reference")[0]
    keller = _train(HEALTHY["muon-keller"], steps=1)[0]
    assert "Keller Jordan's muon_update" in keller.noted("update-reference")[0]
    replay = _train(HEALTHY["adagrad-replayed"], steps=1)[0]
    assert "single-device replay of Adagrad" in replay.noted("update-reference")[0]
    assert replay.verdict == "ok"


def test_a_clip_declared_and_applied_passes() -> None:
    reports = _train(HEALTHY["adam"], steps=10, max_norm=0.05)
    assert [r.verdict for r in reports] == ["ok"] * 10


FAULTS = {
    "muon-row-blocks": (lambda m: models.RowShardedMuon([p for p in m.parameters() if p.ndim == 2], lr=0.02), 1),
    "muon-no-newton-schulz": (lambda m: models.NoNewtonSchulzMuon([p for p in m.parameters() if p.ndim == 2],
                                                                  lr=0.02), 1),
    "adamw-decay-twice": (lambda m: models.TwiceDecayedAdamW(m.parameters(), lr=1e-3, weight_decay=0.1), 1),
    "adam-late-bias-correction": (lambda m: models.LateBiasCorrectionAdam(m.parameters(), lr=1e-3), 5),
}  # fmt: skip


@pytest.mark.parametrize("name", list(FAULTS), ids=list(FAULTS))
def test_a_wrong_update_fails_at_the_first_check_naming_its_tensor(name: str) -> None:
    make, first = FAULTS[name]
    report = _train(make, steps=first, checked=lambda s: s == first)[0]
    assert report.verdict == "fail", str(report)
    assert report.fault == "update"
    failing = report.failures[0].target
    assert f"the update of `{failing}`" in report.fault_message
    assert "cosine" in report.fault_message
    assert "norm ratio" in report.fault_message


def test_a_step_with_the_previous_gradient_is_a_gradient_fault() -> None:
    make = lambda m: models.StaleGradientSGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    report = _train(make, steps=2, checked=lambda s: s == 2, previous=True)[0]
    assert report.verdict == "fail", str(report)
    assert report.fault == "gradient"
    assert "previous step's gradient" in report.fault_message


def test_an_unclipped_step_under_a_declared_clip_is_a_clipping_fault() -> None:
    model = models.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    models.loss_fn(model, models.batch()).backward()
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    named = update_tensors(optimizer, list(model.named_parameters()))
    snapshot = UpdateSnapshot.take(optimizer, named, norm=norm, max_norm=norm / 4)
    optimizer.step()  # the loop forgot to clip
    report = check_update(snapshot, step=1)
    assert report.verdict == "fail", str(report)
    assert report.fault == "clipping"
    assert "unclipped" in report.fault_message


@pytest.mark.slow
def test_the_check_leaves_the_optimizer_untouched() -> None:
    def run(check: bool) -> tuple[list[torch.Tensor], dict]:
        torch.manual_seed(3)
        model = models.mlp()
        optimizer = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
        for step in range(1, 6):
            models.loss_fn(model, models.batch()).backward()
            snapshot = UpdateSnapshot.take(optimizer, update_tensors(optimizer, list(model.named_parameters())))
            optimizer.step()
            if check:
                check_update(snapshot, step=step)
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()], optimizer.state_dict()

    (params, state), (params_checked, state_checked) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(params, params_checked, strict=True))
    for key, entry in state["state"].items():
        assert all(torch.equal(v, state_checked["state"][key][k]) for k, v in entry.items())
    assert state["param_groups"] == state_checked["param_groups"]


def test_the_report_records_the_numerics_the_step_ran_under() -> None:
    torch.manual_seed(0)
    model = models.mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    models.loss_fn(model, models.batch()).backward()
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        snapshot = UpdateSnapshot.take(optimizer, update_tensors(optimizer, list(model.named_parameters())))
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
    optimizer.step()
    report = check_update(snapshot.with_clip(1.0), step=1)
    assert report.numerics is not None
    assert report.numerics.matmul == "tf32"
    assert "tf32" in report.numerics.describe()
