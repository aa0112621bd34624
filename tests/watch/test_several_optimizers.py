"""Applied checks per optimizer in a plain loop (a GAN: two optimizers, each on its own loss): each optimizer's window
recorded with ``record(batch, optimizer=...)`` before its loss's forward, each checked with
``before_optimizer_step(..., optimizer=...)`` against that optimizer's parameters and loss. A healthy GAN is clean and
trains bit for bit as without the watch; a step pre-hook scaling the discriminator's gradient ×1.5 fails the
discriminator's check (only its parameters named), when the check runs from a step pre-hook registered after it."""

from __future__ import annotations

import warnings

import pytest
import torch
from gan_models import GAN, discriminator_loss, gan_state, generator_loss, real_batches, scale_on_step

from gradwatch import AppliedWindow, GradientCheckWarning, GradientWatch, check_applied_gradient
from gradwatch.engine.results.notes import NoteCode

STEPS = 3


def plain_gan_loop(watch: GradientWatch | None, *, fault: float | None = None) -> dict:
    """Discriminator then generator at every step; the checks run in step pre-hooks registered last, so they see the
    gradient each optimizer applies after any other pre-hook."""
    torch.manual_seed(0)
    model = GAN()
    opt_d = torch.optim.Adam(model.discriminator.parameters(), lr=1e-2)
    opt_g = torch.optim.Adam(model.generator.parameters(), lr=1e-2)
    if fault is not None:
        opt_d.register_step_pre_hook(scale_on_step(fault))
    step = 0
    if watch is not None:
        for optimizer, loss in ((opt_d, discriminator_loss), (opt_g, generator_loss)):

            def check(opt: torch.optim.Optimizer, args: object, kwargs: object, loss=loss) -> None:
                watch.before_optimizer_step(model, loss, step=step, optimizer=opt)

            optimizer.register_step_pre_hook(check)
    for step, batch in enumerate(real_batches(STEPS), start=1):
        for optimizer, loss in ((opt_d, discriminator_loss), (opt_g, generator_loss)):
            if watch is not None:
                watch.record(batch, step=step, optimizer=optimizer)
            optimizer.zero_grad()
            loss(model, batch).backward()
            optimizer.step()
    return gan_state(model, opt_d, opt_g)


def _watch() -> GradientWatch:
    return GradientWatch(
        applied_every_n_steps=1, every_n_steps=10**6, max_overhead=None, first_check_step=None, on_fail="raise"
    )


def test_a_healthy_gan_is_clean_per_optimizer_and_trains_as_without_the_watch() -> None:
    watch = _watch()
    with_watch, without = plain_gan_loop(watch), plain_gan_loop(None)
    reports = watch.applied_reports
    assert len(reports) == 2 * STEPS
    assert all(report.verdict == "ok" for report in reports), [r.summary() for r in reports]
    for report, prefix in zip(reports, ["discriminator", "generator"] * STEPS, strict=True):
        assert {p.target.split(".")[0] for p in report.probes if p.target != "*"} <= {prefix}
        assert any("4 trainable parameter(s) not checked" in str(note) for note in report.notes)  # the other's 4
    for name, tensor in without["params"].items():
        assert torch.equal(tensor, with_watch["params"][name]), name
    assert torch.equal(with_watch["rng"], without["rng"])
    assert str(with_watch["optimizers"]) == str(without["optimizers"])


def test_a_step_pre_hook_scaling_the_discriminators_gradient_fails_its_check_alone() -> None:
    watch = GradientWatch(
        applied_every_n_steps=1, every_n_steps=10**6, max_overhead=None, first_check_step=None, on_fail=lambda r: None
    )
    plain_gan_loop(watch, fault=1.5)
    reports = watch.applied_reports
    discriminator, generator = reports[0::2], reports[1::2]
    assert all(report.verdict == "fail" for report in discriminator), [r.summary() for r in discriminator]
    assert all(report.verdict == "ok" for report in generator), [r.summary() for r in generator]
    # the optimizer runs a step pre-hook: the change recurs, from the first check on
    assert [r.fault for r in discriminator] == ["modified"] * STEPS
    assert "Adam: scale_on_step.<locals>.hook" in discriminator[0].fault_message
    failing = {p.target for p in discriminator[0].probes if p.verdict == "fail" and p.target != "*"}
    assert failing
    assert all(name.startswith("discriminator.") for name in failing)


def test_shared_window_and_unknown_optimizer_are_refused_clearly() -> None:
    watch = _watch()
    model = GAN()
    with pytest.raises(ValueError, match=r"`optimizer` must be a torch\.optim\.Optimizer"):
        watch.record(real_batches(1)[0], optimizer="d")  # type: ignore[arg-type]
    stranger = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    watch.record(real_batches(1)[0], step=1)
    discriminator_loss(model, real_batches(1)[0]).backward()
    with pytest.raises(ValueError, match=r"`optimizer` updates none of the model's trainable parameters"):
        watch.before_optimizer_step(model, discriminator_loss, step=1, optimizer=stranger)


def test_a_gradient_edited_by_the_loop_at_every_step_is_modified_from_the_second_check_on() -> None:
    """No hook to see: the first check cannot tell a one-off from a habit (``"transient"``); the next one can."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = GradientWatch(
        applied_every_n_steps=1, every_n_steps=10**6, max_overhead=None, first_check_step=None, on_fail=lambda r: None
    )
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    for step in range(1, 4):
        batch = (torch.randn(8, 4), torch.randn(8, 1))
        watch.record(batch)
        loss_fn(model, batch).backward()
        model.weight.grad.mul_(1.5)  # the loop's own edit, at every step
        watch.before_optimizer_step(model, loss_fn, step=step)
        optimizer.step()
        optimizer.zero_grad()
    reports = watch.applied_reports
    assert [r.fault for r in reports] == ["transient", "modified", "modified"]
    assert "as at the applied check of step 1" in reports[1].fault_message


def test_a_loop_that_records_no_window_is_told_once_that_no_applied_check_runs() -> None:
    model = torch.nn.Linear(4, 1)
    watch = GradientWatch(applied_every_n_steps=1, every_n_steps=10**6, max_overhead=None, first_check_step=None)
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731

    def steps() -> list[object]:
        reports = []
        for step in range(1, 4):
            loss_fn(model, (torch.randn(8, 4), torch.randn(8, 1))).backward()
            reports.append(watch.before_optimizer_step(model, loss_fn, step=step))
        return reports

    with pytest.warns(GradientCheckWarning, match="due at optimizer step 1 has no recorded window") as said:
        assert steps() == [None, None, None]
    assert len([w for w in said if issubclass(w.category, GradientCheckWarning)]) == 1
    quiet = GradientWatch(
        applied_every_n_steps=None, every_n_steps=10**6, max_overhead=None
    )  # switched off by choice: nothing said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.before_optimizer_step(model, loss_fn, step=1)


def test_an_optimizer_whose_parameters_a_watch_ignores_is_passed_over() -> None:
    """A watch for the discriminator's loss (``ignore=["generator.*"]``) checks no step of the generator's optimizer;
    the engine, asked to check nothing, says so (it divided by zero before)."""
    watch = GradientWatch(
        applied_every_n_steps=1,
        every_n_steps=10**6,
        max_overhead=None,
        first_check_step=None,
        on_fail="raise",
        ignore=["generator.*"],
    )
    torch.manual_seed(0)
    model, batch = GAN(), real_batches(1)[0]
    opt_g = torch.optim.Adam(model.generator.parameters(), lr=1e-2)
    watch.record(batch, step=1, optimizer=opt_g)
    generator_loss(model, batch).backward()
    assert watch.before_optimizer_step(model, generator_loss, step=1, optimizer=opt_g) is None
    assert watch.applied_reports == []
    report = check_applied_gradient(model, [batch], generator_loss, ignore=["generator.*", "discriminator.*"])
    assert (report.verdict, report.probes) == ("inconclusive", [])
    assert any(note.code == NoteCode.NOTHING_TO_PROBE for note in report.notes)


def test_an_applied_window_reused_across_steps_calls_a_recurring_change_modified() -> None:
    """By hand, without a watch: one ``AppliedWindow`` cleared after each step; a step pre-hook it is not told of."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.register_step_pre_hook(scale_on_step(1.5))
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    window, faults = AppliedWindow(model), []

    def check(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        faults.append(window.check(loss_fn, step=len(faults) + 1).fault)

    optimizer.register_step_pre_hook(check)
    for _ in range(3):
        batch = (torch.randn(8, 4), torch.randn(8, 1))
        window.record(batch)
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        window.clear()
    assert faults == ["transient", "modified", "modified"]
