"""Notes as data: every note the engine emits is a :class:`Note` with a code listed once, and still the text users
read."""

from __future__ import annotations

import ast
import copy
import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from gradwatch import check_gradients
from gradwatch.engine.results import notes as notes_module
from gradwatch.engine.results.notes import Note, NoteCode, codes
from gradwatch.engine.results.report import CheckReport

PACKAGE = Path(notes_module.__file__).resolve().parents[2]


def _sources() -> dict[str, ast.Module]:
    return {path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_code_is_unique_with_a_one_line_meaning() -> None:
    values = [member.value for member in NoteCode.__members__.values()]
    assert len(values) == len(set(values)), "two members share a code (an Enum alias)"
    for code in NoteCode:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", code.value), code
        assert code.meaning
        assert "\n" not in code.meaning
        assert len(code.meaning) <= 100, code


def test_every_code_is_emitted_somewhere() -> None:
    used = {
        node.attr
        for name, tree in _sources().items()
        if name != "engine/results/notes.py"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "NoteCode"
    }
    assert used <= set(NoteCode.__members__), used - set(NoteCode.__members__)
    assert set(NoteCode.__members__) <= used, f"codes no module emits: {set(NoteCode.__members__) - used}"


def _is_note(node: ast.expr) -> bool:
    """A ``Note(...)`` call, or a name or call whose value the type checker holds to ``Note`` (``list[Note]``)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Note":
        return True
    return isinstance(node, ast.Name)


def test_every_note_the_package_makes_is_a_note_with_a_code() -> None:
    """Whatever is appended to a list of notes is made by ``Note(code, text)`` (the type checker holds the lists to
    ``list[Note]``), and no ``Note`` spells its code as a string (the members of ``NoteCode`` are the codes)."""
    found = []
    for name, tree in _sources().items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "append"
                and "notes" in ast.unparse(node.func.value)
                and not all(_is_note(arg) for arg in node.args)
            ):
                found.append(f"{name}:{node.lineno} appends {ast.unparse(node.args[0])[:60]}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Note":
                code = node.args[0] if node.args else None
                if code is None or isinstance(code, ast.Constant):  # a code spelled out, not a NoteCode member
                    found.append(f"{name}:{node.lineno} makes a Note without a NoteCode")
    assert not found, found


def test_a_note_is_its_text() -> None:
    note = Note(NoteCode.WHOLE_BATCH, "probes use the whole batch")
    assert note == "probes use the whole batch"
    assert hash(note) == hash("probes use the whole batch")
    assert note.startswith("probes use")
    assert str(note) == "probes use the whole batch"
    assert f"note: {note}" == "note: probes use the whole batch"
    assert json.dumps([note]) == '["probes use the whole batch"]'
    assert note.code is NoteCode.WHOLE_BATCH
    assert note.code == "whole-batch"
    assert Note("whole-batch", "text").code is NoteCode.WHOLE_BATCH
    for again in (pickle.loads(pickle.dumps(note)), copy.copy(note), copy.deepcopy(note)):
        assert again == note
        assert again.code is NoteCode.WHOLE_BATCH


def test_an_unknown_code_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`code` must be a NoteCode .*; got 'no-such-code'"):
        Note("no-such-code", "text")


def test_a_report_finds_its_notes_by_code() -> None:
    notes = [Note(NoteCode.SLICE_REFUSED, "a"), "plain", Note(NoteCode.SLICE_REFUSED, "b")]
    report = CheckReport(1, "ok", [], 1.0, 1, 1, duration_s=0.0, notes=notes)  # type: ignore[arg-type]
    assert report.noted(NoteCode.SLICE_REFUSED) == ["a", "b"]
    assert report.noted("slice-refused") == ["a", "b"]
    assert report.noted(NoteCode.WHOLE_BATCH) == []
    assert codes(report.notes) == [NoteCode.SLICE_REFUSED, None, NoteCode.SLICE_REFUSED]


def test_the_notes_of_real_checks_carry_codes() -> None:
    """Checks that leave several notes: a loss refusing a slice of the batch, changing the model's state, warning."""

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 1)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen += 1
            return self.fc(x)

    def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        if len(batch) < 8:
            raise ValueError("expects 8 samples")
        import warnings

        warnings.warn("the loss warns", UserWarning, stacklevel=1)
        return model(batch).square().mean()

    torch.manual_seed(0)
    report = check_gradients(Counting().double(), torch.randn(8, 3, dtype=torch.float64), loss, probe_batch_size=2)
    assert report.verdict == "ok", str(report)
    assert report.notes
    assert all(isinstance(note, Note) for note in report.notes), report.notes
    assert {NoteCode.SLICE_REFUSED, NoteCode.WHOLE_BATCH, NoteCode.WARNINGS_WITHHELD} <= set(codes(report.notes))


def test_the_documentation_lists_every_code_with_its_meaning() -> None:
    page = (PACKAGE.parent / "docs" / "kinds-and-notes.md").read_text()
    missing = [code.value for code in NoteCode if f"| `{code}` | {code.meaning} |" not in page]
    assert not missing, f"docs/kinds-and-notes.md does not list {missing}"
