"""A failing check's culprit search within a cap (:mod:`gradwatch.engine.probing.search_budget`): a deep model's search
stopped by a tiny cap names how far it got, and later checks resumed from there name the module the uncapped search
names; a resume point that no longer holds is dropped; a healthy check spends nothing on it. The cap is spent on an
injected clock that counts its own readings, never on wall time."""

from __future__ import annotations

import pytest
import torch
from culprit_models import Stack, _batch, _cross_entropy

from gradwatch import check_gradients
from gradwatch.engine.probing.search_budget import SearchBudget
from gradwatch.engine.recomputed import probes
from gradwatch.engine.results.notes import NoteCode

PLANTED = "blocks.6.act"


class Readings:
    """A clock that moves one second each time it is read: a budget of ``s`` seconds lasts ``s`` readings."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture(scope="module")
def model() -> Stack:
    return Stack(depth=8, bug_at=6)


@pytest.fixture(scope="module")
def uncapped(model: Stack):
    return check_gradients(model, _batch(), _cross_entropy, precision="float64")


def _capped(
    model: Stack, step: int, within: tuple[str, ...] = (), candidates: tuple[str, ...] = (), seconds: float = 1
):
    budget = SearchBudget(steps=1, step_seconds=seconds, within=within, candidates=candidates, clock=Readings())
    return check_gradients(model, _batch(), _cross_entropy, precision="float64", step=step, search_budget=budget)


def test_the_one_shot_check_searches_to_the_end(uncapped) -> None:
    assert uncapped.verdict == "fail"
    assert uncapped.culprits[:2] == [PLANTED, "blocks.6"]
    assert uncapped.culprit_search is not None
    assert uncapped.culprit_search.complete
    assert not uncapped.noted(NoteCode.CULPRIT_SEARCH_CAPPED)


@pytest.mark.slow
def test_a_tiny_cap_stops_the_search_and_later_checks_go_on_to_the_culprit(model: Stack, uncapped) -> None:
    first = _capped(model, step=0)
    assert first.verdict == "fail"  # the gradient is wrong, whatever the search found
    progress = first.culprit_search
    assert progress is not None
    assert not progress.complete
    assert not progress.resumed
    assert progress.evaluations < uncapped.culprit_search.evaluations / 2
    assert len(first.noted(NoteCode.CULPRIT_SEARCH_CAPPED)) == 1
    assert progress.candidates  # where the bug still lies: the report says how far the search narrowed it
    assert "stopped" in first.culprit_message
    reports = [first]
    while not reports[-1].culprit_search.complete and len(reports) < 12:
        within, candidates = reports[-1].culprit_search.resume_point()
        reports.append(_capped(model, step=len(reports), within=within, candidates=candidates))
        later = reports[-1].culprit_search
        assert later.resumed  # each check goes on from the last, it does not start over
        assert later.evaluations < uncapped.culprit_search.evaluations
        assert set(later.within) >= set(reports[-2].culprit_search.within)  # never less narrowed
    assert reports[-1].culprit_search.complete, [r.culprit_search for r in reports]
    assert reports[-1].culprits == uncapped.culprits
    assert all(r.verdict == "fail" for r in reports)
    assert 2 < len(reports) < 12


def _tensor_probes(report) -> set[str]:
    return {p.target for p in report.probes if p.kind == "tensor"}


def test_a_capped_failing_check_sweeps_the_largest_gradients_first_and_names_the_tensors_left(
    model: Stack, uncapped
) -> None:
    # the sweep of tensor probes after the failure is the first thing the cap spends: a tiny cap screens one round of
    # tensors (those with the largest gradients) and names the rest; the verdict is the uncapped check's
    first = _capped(model, step=0)
    assert first.verdict == uncapped.verdict == "fail"
    (note,) = first.noted(NoteCode.SWEEP_CAPPED)
    assert "max_culprit_search_steps" in note
    swept, everyone = _tensor_probes(first), _tensor_probes(uncapped)
    assert len(everyone) == len(list(model.parameters()))  # uncapped: every tensor named right or wrong
    assert swept < everyone
    norms = {p.target: abs(p.analytic) for p in uncapped.probes if p.kind == "tensor"}  # along g_T/|g_T|: |g_T|
    # the sweep screened one round of the tensors not probed before it (the check's rotating window): that round's
    # gradients are each larger than any left
    round_ = sorted((norms[name] for name in swept), reverse=True)[: probes.SWEPT_AT_ONCE]
    assert len(everyone - swept) > 0
    assert min(round_) >= max(norms[name] for name in everyone - swept)
    assert first.n_forward < uncapped.n_forward
    assert not uncapped.noted(NoteCode.SWEEP_CAPPED)


def test_a_resume_point_that_no_longer_holds_starts_from_the_loss(model: Stack, uncapped) -> None:
    # a healthy block as the place to go on from (the bug moved, say): its input gradient is right, the search starts
    # over and names the culprit the uncapped search names
    report = _capped(model, step=0, within=("", "blocks.2"), candidates=("blocks.2.fc",), seconds=10_000)
    assert report.culprit_search is not None
    assert report.culprit_search.complete
    assert not report.culprit_search.resumed
    assert report.culprits == uncapped.culprits


def test_a_healthy_check_spends_nothing_on_a_search() -> None:
    model, batch = Stack(depth=4), _batch()
    plain = check_gradients(model, batch, _cross_entropy, precision="float64")
    budget = SearchBudget(steps=1, step_seconds=1, within=("", "blocks.1"), clock=Readings())
    capped = check_gradients(model, batch, _cross_entropy, precision="float64", search_budget=budget)
    assert plain.verdict == capped.verdict == "ok"
    assert capped.culprit_search is None
    assert plain.culprit_search is None
    assert (capped.n_forward, capped.n_backward) == (plain.n_forward, plain.n_backward)


@pytest.mark.parametrize(
    ("steps", "step_seconds", "match"),
    [(0, None, "`steps`"), (-3, None, "`steps`"), (True, None, "`steps`"), (1, -1.0, "`step_seconds`")],
    ids=["zero", "negative", "bool", "negative-step"],
)
def test_a_budget_refuses_bad_values(steps: float, step_seconds: float | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SearchBudget(steps=steps, step_seconds=step_seconds)


def test_a_budget_without_a_known_step_takes_the_reference_pass_and_its_floor() -> None:
    budget = SearchBudget(steps=100, clock=Readings(), min_seconds=5.0)
    assert budget.seconds == float("inf")  # no step time yet: no cap
    budget.stand_in(0.01)
    assert budget.seconds == 5.0  # 100 steps of 10 ms, under the floor
    budget.stand_in(1.0)  # a step time once known is kept
    assert budget.seconds == 5.0
    torch.testing.assert_close(SearchBudget(steps=100, step_seconds=0.2).seconds, 20.0)


def test_a_search_resumed_inside_the_named_culprit_names_it_again_for_less(model: Stack, uncapped) -> None:
    within, candidates = uncapped.culprit_search.resume_point()
    assert within[-1] == PLANTED
    assert candidates == ()
    again = check_gradients(model, _batch(), _cross_entropy, precision="float64", step=1,
                            search_budget=SearchBudget(within=within))  # fmt: skip
    assert again.culprits == uncapped.culprits
    assert again.culprit_search.resumed
    assert again.culprit_search.complete
    assert again.culprit_search.evaluations < uncapped.culprit_search.evaluations / 2


@pytest.mark.slow
def test_a_llama_whose_top_module_is_a_source_is_searched_over_capped_checks() -> None:
    # the model's input is token ids: the top module has no input gradient, a source the descent looks at after the
    # chain (a cap that stopped there once spent nothing and never went on)
    from hf_stack_models import plant_activation_bug, tiny_llama, token_ids

    llama = tiny_llama(layers=2)
    planted = plant_activation_bug(llama, 0)
    ids = torch.tensor(token_ids(4, 12))

    def loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(input_ids=batch, labels=batch).loss

    within: tuple[str, ...] = ()
    candidates: tuple[str, ...] = ()
    for step in range(16):
        budget = SearchBudget(steps=1, step_seconds=1e-3, within=within, candidates=candidates, clock=Readings())
        report = check_gradients(llama, ids, loss, step=step, search_budget=budget)
        assert report.verdict == "fail"
        assert report.culprit_search.evaluations > 0  # every check narrows the culprit further
        if report.culprit_search.complete:
            break
        within, candidates = report.culprit_search.resume_point()
    assert report.culprit_search.complete
    assert report.culprits[0] == planted
    assert step > 1
