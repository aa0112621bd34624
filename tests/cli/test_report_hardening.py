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
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

from gradwatch.cli import main
from gradwatch.outputs.jsonl import JSONL_NAME
from gradwatch.tensorboard import files, tfrecord
from gradwatch.tensorboard.tfrecord import _checksum

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


def _event_file(directory: Path, verdicts: tuple[float, ...] = (2.0, 0.0)) -> Path:
    writer = SummaryWriter(str(directory))
    for step, verdict in enumerate(verdicts, start=1):
        writer.add_scalar("gradwatch/verdict", verdict, step)
        writer.add_scalar("gradwatch/rel_error_max", 0.05, step)
        writer.add_histogram("gradwatch/rel_error_log10", torch.tensor([-7.0, -6.5, -1.3]), step)
    table = "| kind | tensor | index | analytic | numeric | rel. error |\n|---|---|---|---|---|---|\n"
    writer.add_text(
        "gradwatch/failures",
        "culprit: the backward of `fc` is wrong\n\n" + table + "| param | `w` | 1 | 1 | 2 | 0.5 |",
        1,
    )
    writer.close()
    (path,) = directory.glob("events.out.tfevents.*")
    return path


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


def test_a_fifo_named_like_an_event_file_is_refused_unopened(tmp_path: Path) -> None:
    _failing_run(tmp_path / "run")
    fifo = tmp_path / "run" / "events.out.tfevents.123.host"
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


@pytest.mark.parametrize(
    ("value", "shown"), [(float("nan"), "nan"), (float("inf"), "inf"), (7.0, "7.0"), (0.5, "0.5"), (-1.0, "-1.0")],
    ids=["nan", "inf", "out-of-range", "fraction", "negative"],
)  # fmt: skip
def test_a_verdict_scalar_that_is_not_a_verdict_is_refused(tmp_path: Path, value: float, shown: str) -> None:
    path = _event_file(tmp_path / "run", verdicts=(0.0, value))
    _refused(
        ["report", str(tmp_path)],
        f"{path}: the gradwatch/verdict scalar at step 2 is {shown} (expected 0 ok, 1 inconclusive or 2 fail)",
    )


def _with_length(data: bytes, length: int) -> bytes:
    """``data`` whose first record's header claims ``length`` bytes, with a header checksum that matches."""
    header = struct.pack("<Q", length)
    return header + struct.pack("<I", _checksum(header)) + data[12:]


def test_a_record_header_claiming_2_to_the_62_bytes_is_corrupt_not_a_memory_error(tmp_path: Path) -> None:
    path = _event_file(tmp_path / "run")
    path.write_bytes(_with_length(path.read_bytes(), 1 << 62))
    _refused(["report", str(tmp_path)], f"corrupt event file {path}: the record at byte 0 claims {1 << 62} bytes")


def test_a_record_longer_than_the_bound_is_checked_in_chunks_never_held_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = SummaryWriter(str(tmp_path / "run"))
    writer.add_text("someone_elses/notes", "x" * 400_000, 1)  # one 400 KB record
    writer.add_scalar("gradwatch/verdict", 0.0, 1)
    writer.close()
    monkeypatch.setattr(tfrecord, "MAX_RECORD_BYTES", 16 << 10)
    monkeypatch.setattr(tfrecord, "_CHUNK", 16 << 10)
    tracemalloc.start()
    try:
        code, out, _ = _run(["report", str(tmp_path)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert code == 0, out
    assert peak < 200_000  # well under the record's 400 KB


def _mutations(data: bytes, boundaries: set[int], rng: random.Random) -> list[tuple[str, bytes, bool]]:
    """(name, content, must_be_refused) for corrupt versions of an event file."""
    cases = []
    for _ in range(12):
        cut = rng.randrange(1, len(data))
        cases.append((f"truncated at {cut}", data[:cut], cut not in boundaries))
    for _ in range(12):
        position = rng.randrange(len(data))
        flipped = bytearray(data)
        flipped[position] ^= 1 << rng.randrange(8)
        cases.append((f"bit flip at {position}", bytes(flipped), True))
    for length in (1 << 62, (1 << 64) - 1, 1 << 32, len(data), len(data) - 15):
        cases.append((f"length {length}", _with_length(data, length), True))
    cases.append(("zeros", bytes(len(data)), True))
    cases.append(("empty", b"", True))  # no record at all: no gradwatch data
    return cases


def _boundaries(data: bytes) -> set[int]:
    offsets, offset = set(), 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        offset += 16 + length
        offsets.add(offset)
    return offsets


def test_fuzz_corrupt_event_files_exit_as_documented_within_time_and_memory_bounds(tmp_path: Path) -> None:
    rng = random.Random(0)
    source = _event_file(tmp_path / "source")
    data = source.read_bytes()
    cases = _mutations(data, _boundaries(data), rng)
    for value in (float("nan"), float("inf"), float("-inf"), 3.0, -0.0):  # bad values, well framed
        cases.append((f"verdict {value}", _event_file(tmp_path / f"v{value}", (2.0, value)).read_bytes(), value != 0))
    for number, (name, content, must_refuse) in enumerate(cases):
        run = tmp_path / "fuzz" / str(number)
        run.mkdir(parents=True)
        (run / source.name).write_bytes(content)
        started = time.perf_counter()
        tracemalloc.start()
        try:
            code, out, err = _run(["report", str(run)])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert time.perf_counter() - started < 10, name
        assert peak < 2_000_000, (name, peak)  # whatever the header claims (2^62 bytes included)
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
        (run / source.name).write_bytes(content)
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


def test_a_scalar_tensor_claiming_a_huge_shape_is_refused_before_it_is_allocated(tmp_path: Path) -> None:
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.summary.writer.record_writer import RecordWriter

    tensor = TensorProto(
        dtype=1, float_val=[2.0], tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1 << 40)])
    )
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="scalars"))
    value = Summary.Value(tag="gradwatch/verdict", tensor=tensor, metadata=metadata)
    run = tmp_path / "run"
    run.mkdir()
    path = run / "events.out.tfevents.1.host"
    with open(path, "wb") as handle:
        RecordWriter(handle).write(Event(step=1, summary=Summary(value=[value])).SerializeToString())
    _refused(["report", str(tmp_path)], f"{path}: the scalar 'gradwatch/verdict' at step 1 has the shape [{1 << 40}]")
