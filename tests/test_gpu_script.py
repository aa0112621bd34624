"""``benchmarks/gpu.sh --device cpu``, the dry run of the GPU benchmark: it runs end to end on a CPU, so that the script
is known to work before it meets a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_benchmark_runs_end_to_end_on_a_cpu(tmp_path: Path) -> None:
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--device", "cpu", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=environment)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert [line.split(":")[0] for line in summary.splitlines()] == ["applied-cost", "gpu-checks", "cuda-tests"]
    assert all(": exit 0 after" in line for line in summary.splitlines()), summary
    checks = (tmp_path / "gpu-checks.md").read_text()
    for table in ("| model | native forward |", "| model | step peak |", "| model | precision |"):
        assert table in checks, checks
    assert "| CNN | 32-true TF32 on |" in checks
    assert " fail" not in checks
    refused = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--device", "tpu"], capture_output=True,
                             text=True, env=environment)  # fmt: skip
    assert "--device must be cuda or cpu" in refused.stderr


def test_the_gpu_benchmark_without_cuda_points_to_the_dry_run() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--device", "cuda", "/tmp/gradwatch-gpu-none"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert "--device cpu is the dry run" in done.stderr
