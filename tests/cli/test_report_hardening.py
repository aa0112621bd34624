"""``gradwatch report`` on hostile or odd input: exit 2 with the path and the reason in one line for anything it cannot
fully read, never a traceback, never exit 0 after skipping something, regular files only, memory bounded; a reader
that goes away (``| head``) ends the output quietly; the tables rank tensors and list every culprit up to a limit."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from gradwatch.cli import main
from gradwatch.outputs import logdir as files
from gradwatch.outputs.jsonl import JSONL_NAME

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXIT_CODES = {0, 1, 2, 3}


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _subprocess(*args: str, shell: bool = False, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    command: Any = args[0] if shell else [sys.executable, "-m", "gradwatch", *args]
    return subprocess.run(command, shell=shell, capture_output=True, text=True, env=env, timeout=timeout)


def _check(step: int, verdict: str = "fail", failures: list[dict[str, Any]] | None = None, **more: Any) -> str:
    if failures is None:
        failures = [{"kind": "tensor", "target": "fc.weight", "index": None, "analytic": 1.0, "numeric": 1.1}]
    record = {"format": "gradwatch-check", "version": 1, "step": step, "verdict": verdict, "scalars": {},
              "failures": failures if verdict == "fail" else [], **more}  # fmt: skip
    return json.dumps(record) + "\n"


def _failing_run(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / JSONL_NAME).write_text(_check(1) + _check(2, "ok"))
    return directory


def _refused(argv: list[str], reason: str) -> str:
    code, out, err = _run(argv)
    assert code == 2, (out, err)
    assert out == ""
    lines = err.splitlines()
    assert lines
    assert all(line.startswith("gradwatch report: error: ") for line in lines)
    assert reason in err, err
    return err


def test_an_unreadable_directory_holding_a_failing_run_is_not_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _failing_run(tmp_path / "a")
    hidden = _failing_run(tmp_path / "b" / "secret")
    real_scandir = os.scandir

    def scandir(path: Any) -> Any:  # the tests run as root, who reads everything: deny it here
        if Path(path) == hidden.parent:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(files.os, "scandir", scandir)
    _refused(["report", str(tmp_path)], f"{hidden.parent}: cannot read the directory (Permission denied)")


def test_an_unreadable_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = _failing_run(tmp_path / "run") / JSONL_NAME
    real_open = os.open

    def denied(path: Any, flags: int, *args: Any) -> int:
        if Path(path) == record:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(files.os, "open", denied)
    _refused(["report", str(tmp_path)], f"{record}: cannot read the file (Permission denied)")


def test_a_fifo_named_like_a_record_is_refused_unopened(tmp_path: Path) -> None:
    _failing_run(tmp_path / "run")
    (tmp_path / "other").mkdir()
    fifo = tmp_path / "other" / JSONL_NAME
    os.mkfifo(fifo)
    signal.alarm(60)  # were it opened for reading, the command would wait for a writer forever
    try:
        code, out, err = _run(["report", str(tmp_path)])
    finally:
        signal.alarm(0)
    assert (code, out) == (2, "")
    assert err == f"gradwatch report: error: {fifo}: a FIFO, not a regular file; refused (never opened)\n"


def test_names_that_are_not_utf8_are_refused_by_path(tmp_path: Path) -> None:
    _failing_run(tmp_path / "run")
    odd = os.fsencode(tmp_path) + b"/caf\xe9"
    os.mkdir(odd)
    with open(odd + b"/" + JSONL_NAME.encode(), "w") as handle:
        handle.write(_check(1))
    err = _refused(["report", str(tmp_path)], "a file name that is not valid UTF-8, which gradwatch cannot decode")
    assert "caf\\xe9" in err
    done = _subprocess("report", str(tmp_path))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr


def _mutations(data: bytes, rng: random.Random) -> list[tuple[str, bytes, bool]]:
    """(name, content, must_be_refused) for damaged versions of a record."""
    boundaries = {i + 1 for i, byte in enumerate(data) if byte == ord("\n")}
    cases = []
    for _ in range(12):
        cut = rng.randrange(1, len(data))
        cases.append((f"truncated at {cut}", data[:cut], cut not in boundaries))
    for _ in range(24):
        position = rng.randrange(len(data))
        flipped = bytearray(data)
        flipped[position] ^= 1 << rng.randrange(8)
        cases.append((f"bit flip at {position}", bytes(flipped), False))  # may still be a record: read as one
    cases.append(("zeros", bytes(len(data)), True))
    cases.append(("empty", b"", True))  # no record at all: no gradwatch data
    return cases


def test_fuzz_damaged_records_exit_as_documented_within_time_and_memory_bounds(tmp_path: Path) -> None:
    rng = random.Random(0)
    data = (_failing_run(tmp_path / "source") / JSONL_NAME).read_bytes()
    cases = _mutations(data, rng)
    for number, (name, content, must_refuse) in enumerate(cases):
        run = tmp_path / "fuzz" / str(number)
        run.mkdir(parents=True)
        (run / JSONL_NAME).write_bytes(content)
        started = time.perf_counter()
        tracemalloc.start()
        try:
            code, out, err = _run(["report", str(run)])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert time.perf_counter() - started < 10, name
        assert peak < 2_000_000, (name, peak)
        assert code in EXIT_CODES, name
        if must_refuse:
            assert code == 2, (name, out)
        if code == 2:
            assert out == "", name
            assert len(err.splitlines()) == 1, (name, err)
            assert str(run) in err, (name, err)
    for name, content, _ in cases[::20]:  # two through the real entry point: no traceback
        run = tmp_path / "subprocess" / name.replace(" ", "_")
        run.mkdir(parents=True)
        (run / JSONL_NAME).write_bytes(content)
        done = _subprocess("report", str(run))
        assert done.returncode in EXIT_CODES, (name, done.stderr)
        assert "Traceback" not in done.stderr, (name, done.stderr)


def test_head_ends_the_output_quietly_and_the_verdict_stands(tmp_path: Path) -> None:
    run = tmp_path / "long"
    run.mkdir()
    (run / JSONL_NAME).write_text("".join(_check(step) for step in range(1, 3001)))  # ~500 KB of report
    pipeline = f"set -o pipefail; {sys.executable} -m gradwatch report {run} --max-rows 0 | head -n 3"
    done = _subprocess(f"bash -c '{pipeline}'", shell=True)
    assert done.stdout.splitlines()[0] == f"gradwatch report: {run} (1 run)"
    assert done.stderr == ""  # no BrokenPipeError, no "Exception ignored"
    assert done.returncode == 1  # the failure recorded, not a crash


def test_worst_tensors_are_tensors_and_every_culprit_is_listed_up_to_the_limit(tmp_path: Path) -> None:
    search = [
        {"kind": "module_input", "target": "", "index": None, "analytic": 1.0, "numeric": 3.0},
        {"kind": "activation", "target": "net.1", "index": None, "analytic": 1.0, "numeric": 2.0},
    ]
    victim = [{"kind": "tensor", "target": "net.0.weight", "index": None, "analytic": 1.0, "numeric": 1.02}]
    lines = [_check(s, failures=victim + search, culprit=f"the backward of `net.1` is wrong ({s})") for s in range(25)]
    (tmp_path / JSONL_NAME).write_text("".join(lines))
    code, out, _ = _run(["report", str(tmp_path)])
    assert code == 1
    worst = out.split("worst tensors", 1)[1].split("failures:", 1)[0]
    assert "net.0.weight" in worst
    assert "(the model)" not in worst
    assert "net.1" not in worst
    assert "(the model)" in out.split("failures:", 1)[1]  # still listed among the failures
    culprits = [line for line in out.splitlines() if line.startswith("culprit at step")]
    assert len(culprits) == 20
    assert "... and 5 more culprit lines (--max-rows 0 shows all)" in out
    code, out, _ = _run(["report", str(tmp_path), "--max-rows", "0"])
    assert sum(line.startswith("culprit at step") for line in out.splitlines()) == 25


def test_the_command_line_imports_lightning_only_to_train_a_demo() -> None:
    done = _subprocess(
        f"{sys.executable} -c \"import sys, gradwatch.cli.main; assert 'lightning' not in sys.modules\"", shell=True
    )
    assert done.returncode == 0, done.stderr
