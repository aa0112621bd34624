"""Probe kinds, verdicts and reasons: one table of kinds drives the engine; the enums act as the strings they were."""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import math
import pickle
from pathlib import Path

import pytest

from gradwatch.cli.demo import describe
from gradwatch.engine.culprits.sites import PLACES
from gradwatch.engine.probing.outcome import overall_verdict
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.results import kinds
from gradwatch.engine.results.kinds import PROBE_KINDS, KindTraits, ProbeKind, Reason, Verdict, kinds_where
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.rendering import SEARCH_KINDS, ordered_failures
from gradwatch.engine.results.report import UNDECIDED_REASONS, VERDICTS, CheckReport, Probe

PACKAGE = Path(kinds.__file__).resolve().parents[2]
KIND_NAMES = {kind.value for kind in ProbeKind}
OWN_KINDS = {"engine/results/kinds.py", "engine/function/sandbox.py"}
"""Modules allowed to spell kind names: the table itself and the sandbox, whose saved objects have kinds of their own
("tensor", "module", "dict")."""


def _probe(kind: str, verdict: str = "ok", reason: str = "agrees", index: tuple[int, ...] | None = None) -> Probe:
    return Probe(kind, "w", index, 1.0, 1.0, 0.0, verdict=verdict, noise=0.0, step=1e-3, reason=reason)  # type: ignore[arg-type]


def _report(*probes: Probe, verdict: str = "inconclusive") -> CheckReport:
    return CheckReport(1, verdict, list(probes), 1.0, 1, 1, duration_s=0.0)  # type: ignore[arg-type]


def _sources() -> dict[str, ast.Module]:
    return {path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


# ---- the table ---------------------------------------------------------------------------------------------------


def test_every_kind_has_one_row_and_a_meaning() -> None:
    assert set(PROBE_KINDS) == set(ProbeKind)
    assert all(isinstance(row, KindTraits) and row.meaning for row in PROBE_KINDS.values())
    assert all(kind.traits is PROBE_KINDS[kind] for kind in ProbeKind)


def test_no_module_lists_or_compares_kind_names_outside_the_table() -> None:
    """A new kind must not need a tuple of kind names edited elsewhere: the engine asks the table's properties."""
    found = []
    for name, tree in _sources().items():
        if name in OWN_KINDS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                values = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                if len(values) >= 2 and len(values) == len(node.elts) and set(values) <= KIND_NAMES:
                    found.append(f"{name}:{node.lineno} lists {values}")
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                on_kind = any(
                    (isinstance(s, ast.Attribute) and s.attr == "kind") or (isinstance(s, ast.Name) and s.id == "kind")
                    for s in sides
                )
                literals = [s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
                if on_kind and set(literals) & KIND_NAMES:
                    found.append(f"{name}:{node.lineno} compares a kind with {literals}")
    assert not found, found


def test_every_kind_the_code_names_is_in_the_table() -> None:
    named = {
        node.attr
        for tree in _sources().values()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ProbeKind"
    }
    assert named, "no module names a kind"
    assert named <= set(ProbeKind.__members__), named - set(ProbeKind.__members__)


def test_kinds_where_selects_by_property_and_refuses_unknown_ones() -> None:
    assert kinds_where(culprit_search=True) == PLACES == ("activation", "module_input", "module_params")
    assert set(kinds_where(moves_inputs=True)) == {ProbeKind.INPUT}
    starting = {"descent", "cover", "tensor", "tensors", "random", "param", "input"}
    assert set(kinds_where(starts_culprit_search=True)) == starting
    with pytest.raises(ValueError, match=r"`traits` must name fields of KindTraits; got \['flies'\]"):
        kinds_where(flies=True)


# ---- the properties drive the engine -----------------------------------------------------------------------------


def _patched(monkeypatch: pytest.MonkeyPatch, kind: ProbeKind, **traits: bool) -> None:
    monkeypatch.setitem(PROBE_KINDS, kind, dataclasses.replace(PROBE_KINDS[kind], **traits))


def test_refocused_kinds_name_the_undecided_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    report = _report(_probe("tensor", "inconclusive", "kink"), _probe("random", "inconclusive", "kink"))
    assert report.undecided == ("w",)
    _patched(monkeypatch, ProbeKind.TENSOR, refocused=False)
    assert report.undecided == ()
    _patched(monkeypatch, ProbeKind.RANDOM, refocused=True)
    assert report.undecided == ("w",)


def test_an_agreeing_probe_of_a_vouching_kind_makes_the_check_ok(monkeypatch: pytest.MonkeyPatch) -> None:
    along_inputs = _probe("input")
    assert overall_verdict([along_inputs]) == Verdict.OK
    assert overall_verdict([_probe("input", index=(0,))]) == Verdict.INCONCLUSIVE  # a coordinate vouches for little
    _patched(monkeypatch, ProbeKind.INPUT, vouches=False)
    assert overall_verdict([along_inputs]) == Verdict.INCONCLUSIVE
    assert overall_verdict([along_inputs, _probe("param", "fail", "discrepancy", (0,))]) == "fail"


def test_culprit_search_probes_are_listed_after_the_victims_and_are_none() -> None:
    activation = Probe("activation", "blocks.0", None, 1.0, 2.0, 0.5, verdict="fail", noise=0.0, step=1e-3,
                       reason="discrepancy")  # type: ignore[arg-type]  # fmt: skip
    failing = _report(activation, _probe("tensor", "fail", "discrepancy"), verdict="fail")
    assert kinds_where(culprit_search=True) == SEARCH_KINDS
    assert [p.kind for p in ordered_failures(failing)] == ["tensor", "activation"]
    listed = [line for line in describe("run", [failing]).splitlines() if line.startswith("tensors with failing")]
    assert listed == ["tensors with failing probes over the run: w"]


# ---- the enums are the strings they replaced ---------------------------------------------------------------------


def test_probes_and_tasks_take_strings_and_hold_members() -> None:
    probe = _probe("param", "fail", "discrepancy", (0,))
    assert probe.kind is ProbeKind.PARAM
    assert probe.verdict is Verdict.FAIL
    assert probe.reason is Reason.DISCREPANCY
    assert probe.kind == "param"
    assert probe.verdict == "fail"
    assert probe.describe().startswith("param w[0]: ")
    assert probe.describe().endswith("-> fail (discrepancy)")
    task = ProbeTask("tensor", "w", None, None, 1e-3, 0.0)  # type: ignore[arg-type]
    assert task.kind is ProbeKind.TENSOR
    assert task.kind.traits.refocused


@pytest.mark.parametrize(
    ("argument", "fields"),
    [
        ("kind", {"kind": "gradient"}),
        ("verdict", {"verdict": "pass"}),
        ("reason", {"reason": "because"}),
    ],
    ids=["kind", "verdict", "reason"],
)
def test_a_probe_of_an_unknown_kind_verdict_or_reason_is_refused(argument: str, fields: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=rf"`{argument}` must be one of '.*'; got '{fields[argument]}'"):
        _probe(**{"kind": "param", **fields})


def test_verdicts_format_serialise_and_pickle_as_their_values() -> None:
    assert VERDICTS == ("ok", "inconclusive", "fail")
    assert [VERDICTS.index(v) for v in ("ok", "inconclusive", "fail")] == [0, 1, 2]
    assert f"{Verdict.FAIL}|{ProbeKind.MODULE_INPUT:>14}|{Reason.KINK}" == "fail|  module_input|kink"
    assert str(Verdict.OK) == "ok"
    assert repr(Verdict.OK) == "'ok'"  # reports and doctests read as with plain strings
    assert "%s" % ProbeKind.DESCENT == "descent"  # noqa: UP031 (how logging formats it)
    assert json.dumps({"verdict": Verdict.FAIL, "kind": ProbeKind.TENSOR}) == '{"verdict": "fail", "kind": "tensor"}'
    assert {"fail": 1}[Verdict.FAIL] == 1
    report = _report(_probe("tensor"), verdict="ok")
    report = dataclasses.replace(report, notes=[Note(NoteCode.WHOLE_BATCH, "probes use the whole batch")])
    for again in (pickle.loads(pickle.dumps(report)), copy.deepcopy(report)):
        assert again.probes == report.probes
        assert again.notes == report.notes
        assert again.verdict is Verdict.OK
        assert again.probes[0].kind is ProbeKind.TENSOR
        assert again.noted(NoteCode.WHOLE_BATCH) == ["probes use the whole batch"]
    assert math.isnan(_report().descent_ratio)


def test_undecided_reasons_are_the_retried_ones() -> None:
    assert set(UNDECIDED_REASONS) == {"kink", "unresolved", "unstable", "tie"}
    assert not Reason.FLAT.retried


def test_the_documentation_lists_every_kind_with_its_properties() -> None:
    page = (PACKAGE.parent / "docs" / "kinds-and-notes.md").read_text()
    flags = [f.name for f in dataclasses.fields(KindTraits) if f.name != "meaning"]
    for kind, row in PROBE_KINDS.items():
        cells = ["✓" if getattr(row, flag) else "" for flag in flags]
        assert f"| `{kind}` | {row.meaning} | {' | '.join(cells)} |" in page, kind
