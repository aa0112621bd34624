"""Run a two-process Lightning script (DDP, FSDP2 on CPU with gloo) in a subprocess and read what each rank wrote.

Lightning's launcher starts rank 1 by running the script again, so such fits cannot run inside pytest. The script runs
in a new session with a bounded timeout: a hang fails the test (and kills rank 1 with rank 0) instead of blocking the
suite. Each rank writes ``OUT_DIR/<scenario>_rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

TESTS = Path(__file__).resolve().parent

needs_gloo = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="needs gloo"
)


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
