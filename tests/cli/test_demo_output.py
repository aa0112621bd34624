"""What ``gradwatch demo`` prints: the next steps name the TensorBoard tab to open, and a redirected output gets no
progress bar."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import gradwatch.cli.demo

ROOT = Path(__file__).resolve().parents[2]


def test_the_next_steps_name_the_dashboards_tab_and_each_runs_summary() -> None:
    text = gradwatch.cli.demo.next_steps(Path("logs"), ["healthy", "rmsnorm"])
    assert "tensorboard --logdir logs" in text
    assert "http://localhost:6006/#custom_scalars" in text
    assert "CUSTOM SCALARS tab" in text
    assert "gradwatch report logs/rmsnorm" in text


@pytest.mark.slow
def test_a_redirected_output_gets_no_progress_bar(tmp_path: Path) -> None:
    # stdout is a pipe here, as in `gradwatch demo > out.txt` or `| tee`
    command = [sys.executable, "-m", "gradwatch", "demo", "--bug", "none", "--steps", "3", "--every", "50"]
    command += ["--logdir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "\r" not in done.stdout
    assert "it/s" not in done.stdout
    assert "#custom_scalars" in done.stdout
