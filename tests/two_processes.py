"""Run a two-process script (Lightning's DDP and FSDP2, DeepSpeed, tensor parallelism; CPU, gloo) in subprocesses and
read what each rank wrote.

Lightning's launcher starts rank 1 by running the script again, so such fits cannot run inside pytest
(:func:`run_ranks`); other scripts are started once per rank with the launcher's variables set, as ``torchrun`` sets
them (:func:`run_launched`). Scripts run in a new session with a bounded timeout: a hang fails the test (and kills
every rank) instead of blocking the suite. Each rank writes ``OUT_DIR/<scenario>_rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

TESTS = Path(__file__).resolve().parent

needs_gloo = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="needs gloo"
)


def serve_scenarios(run: Callable[[str], dict[str, Any]]) -> None:
    """A launched rank's main: join the gloo group, run each scenario named on the command line (after ``OUT``) and
    write what ``run`` returns (with its ``"rank"``) to ``OUT/<scenario>_rank<r>.json``; once every rank has written
    its results, leave without the interpreter's teardown (:func:`leave_without_teardown`: a device mesh's gloo state
    aborted a rank there in CI)."""
    out = Path(sys.argv[1])
    torch.distributed.init_process_group("gloo")
    for scenario in sys.argv[2:]:
        result = run(scenario)
        (out / f"{scenario}_rank{result['rank']}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    leave_without_teardown()


def leave_without_teardown() -> None:
    """End a launched rank once every result is written, without the interpreter's teardown, in which DeepSpeed's and
    the Trainer's gloo state sometimes abort a rank ("terminate called without an active exception") and leave the
    other waiting."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(script: str, out: Path, *options: str, timeout_s: int) -> tuple[dict[str, Any], str]:
    """Run ``tests/<script> OUT *options``; returns each JSON file it wrote in ``out`` (by file stem) and its output.
    Fails the test on a non-zero exit or when it runs past ``timeout_s``."""
    paths = [str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)))
    process = subprocess.Popen(
        [sys.executable, str(TESTS / script), str(out), *options],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{script} hung (no exit within {timeout_s} s):\n{output.decode()[-5000:]}")
    assert process.returncode == 0, output.decode()[-5000:]
    return {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}, output.decode()


def _wait_for_ranks(processes: list[subprocess.Popen[bytes]], deadline: float, grace_s: float = 20.0) -> None:
    """Wait until every rank has exited or ``deadline`` passes; once one rank fails, the others get ``grace_s`` more
    (they are usually waiting for it in a collective) instead of the whole timeout."""
    while time.monotonic() < deadline:
        codes = [process.poll() for process in processes]
        if all(code is not None for code in codes):
            return
        if any(code not in (None, 0) for code in codes):
            deadline = min(deadline, time.monotonic() + grace_s)
        time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


_GLOO_ABORT = "terminate called without an active exception"


def run_launched(
    script: str, out: Path, *options: str, timeout_s: int, world: int = 2, env: dict[str, str] | None = None
) -> tuple[dict[str, Any], str]:
    """Run ``tests/<script> OUT *options`` once per rank of a ``world`` of processes, with the variables ``torchrun``
    sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and ``env`` added; returns each
    JSON file the ranks wrote in ``out`` (by file stem) and their output, rank 0's first. Fails the test when a rank
    exits non-zero or they run past ``timeout_s``. A run in which a rank was aborted by gloo's C++ runtime
    (``SIGABRT`` with "terminate called without an active exception", a crash of the library's threads, not of the
    script's Python) is made once more before it fails."""
    for attempt in (1, 2):
        codes, outputs, timed_out = _launch(script, out, options, timeout_s=timeout_s, world=world, env=env)
        aborted = any(code == -signal.SIGABRT and _GLOO_ABORT in o for code, o in zip(codes, outputs, strict=True))
        if all(code == 0 for code in codes) or not aborted or attempt == 2:
            break
        for path in out.glob("*.json"):
            path.unlink()
    if any(code != 0 for code in codes):
        written = sorted(path.name for path in out.glob("*.json"))
        what = f"hung (no exit within {timeout_s} s)" if timed_out else "ended early"
        pytest.fail(
            f"{script} {what} (attempt {attempt}): exit codes by rank {codes} (negative: killed by that signal), "
            f"results written {written}:\n" + "".join(f"--- rank {r}\n{o[-3000:]}" for r, o in enumerate(outputs))
        )
    return {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}, "\n".join(outputs)


def _launch(
    script: str, out: Path, options: tuple[str, ...], *, timeout_s: int, world: int, env: dict[str, str] | None
) -> tuple[list[int | None], list[str], bool]:
    """One launch of ``world`` ranks: each rank's exit code, its output, and whether the run reached ``timeout_s``."""
    paths = [str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH")]
    common = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)), OMP_NUM_THREADS="1", **(env or {}))
    common.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world))
    logs = [(out / f"rank{rank}.log").open("wb") for rank in range(world)]
    processes = [
        subprocess.Popen(
            [sys.executable, str(TESTS / script), str(out), *options],
            env=dict(common, RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)),
            stdout=logs[rank],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        _wait_for_ranks(processes, deadline)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for log in logs:
            log.close()
    outputs = [(out / f"rank{rank}.log").read_text(errors="replace") for rank in range(world)]
    return [process.returncode for process in processes], outputs, time.monotonic() >= deadline
