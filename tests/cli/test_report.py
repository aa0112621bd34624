"""The gradwatch command: ``demo`` trains and prints verdicts, ``report`` summarises the records of its runs."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from gradwatch.cli import main
from gradwatch.cli import reporting as report_command
from gradwatch.outputs.jsonl import JSONL_NAME
from gradwatch.outputs.reading import read_logdir


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def demo_logdir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``gradwatch demo`` on the healthy model and the wrong custom backward, short runs: the logdir and stdout."""
    logdir = tmp_path_factory.mktemp("demo") / "logs"
    argv = ["demo", "--logdir", str(logdir), "--bug", "none", "--bug", "rmsnorm", "--steps", "12", "--every", "6"]
    code, out, _ = _run([*argv, "--no-progress-bar"])
    assert code == 0, out
    return logdir, out


@pytest.mark.slow
def test_demo_prints_verdicts_and_the_tensorboard_command(demo_logdir: tuple[Path, str]) -> None:
    logdir, out = demo_logdir
    assert "healthy: no false alarm (3 checks, none failed)" in out
    assert "rmsnorm: caught at step 1 (the first check), culprit `net[1]`; 3 of 3 checks failed" in out
    assert "gradient check failed at step 1: the backward of `net[1]` (`RMSNorm`) is wrong" in out
    assert f"tensorboard --logdir {logdir}" in out
    assert f"gradwatch report {logdir / 'rmsnorm'}" in out
    assert sorted(p.name for p in logdir.iterdir()) == ["healthy", "rmsnorm"]


@pytest.mark.slow
def test_report_on_the_healthy_run_exits_0(demo_logdir: tuple[Path, str]) -> None:
    code, out, _ = _run(["report", str(demo_logdir[0] / "healthy")])
    assert code == report_command.EXIT_OK
    assert "== run version_0: 3 checks, steps 1 to 12: 3 ok, 0 inconclusive, 0 fail ==" in out
    assert "checks (verdicts over time):" in out
    assert "failures:" not in out
    assert out.rstrip().endswith("result: ok, no gradient failure recorded (exit status 0)")


@pytest.mark.slow
def test_report_on_the_buggy_run_lists_each_failure_and_exits_1(demo_logdir: tuple[Path, str]) -> None:
    logdir = demo_logdir[0] / "rmsnorm"
    code, out, _ = _run(["report", str(logdir), "--max-rows", "0"])
    assert code == report_command.EXIT_FAILURE_RECORDED
    # the applied check at the first check step sees the wrong backward too: a formula fault, named in the header
    assert "3 fail; first failure at step 1; formula fault in the applied gradient at step 1 ==" in out
    assert "formula fault at step 1: the eager float32 recomputation disagrees with the loss too" in out
    assert "culprit at step 1: the backward of `net[1]` (`RMSNorm`) is wrong: its input gradient is" in out
    assert "worst tensors" in out
    assert "net.0.weight" in out  # upstream of the broken backward
    (run,) = read_logdir(logdir)
    failures_section = out.split("\nfailures:\n", 1)[1]
    for failure in run.failures:  # every failure: step, kind, tensor, index, analytic and numeric
        cells = [str(failure.step), failure.kind, failure.tensor, failure.index or "-"]
        cells += [f"{failure.analytic:.6g}", f"{failure.numeric:.6g}"]
        expected = " ".join(cells).split()  # the rel. error follows in the last column
        assert any(line.split()[:-1] == expected for line in failures_section.splitlines()), cells
    assert "result: FAIL, gradient failures recorded in version_0 (exit status 1)" in out


@pytest.mark.slow
def test_report_over_several_runs_fails_if_any_failed(demo_logdir: tuple[Path, str]) -> None:
    code, out, _ = _run(["report", str(demo_logdir[0]), "--max-rows", "2"])
    assert code == report_command.EXIT_FAILURE_RECORDED
    assert "(2 runs)" in out
    assert "== run healthy/version_0:" in out
    assert "== run rmsnorm/version_0:" in out
    assert "more failures (--max-rows 0 shows all)" in out
    assert "recorded in rmsnorm/version_0 (exit status 1)" in out


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", r"log directory .* does not exist"),
        ("empty", r"no gradwatch records under .*: no gradwatch\.jsonl, nor a Weights & Biases or MLflow run folder$"),
        ("corrupt", r"gradwatch\.jsonl: line \d+ is cut short \(no newline\): a truncated record"),
    ],
    ids=["missing", "empty", "corrupt"],
)
@pytest.mark.slow
def test_report_on_bad_input_exits_2_with_a_clear_error(
    demo_logdir: tuple[Path, str], tmp_path: Path, setup: str, message: str
) -> None:
    target = tmp_path / "logs"
    if setup == "empty":
        target.mkdir()
    elif setup == "corrupt":
        source = demo_logdir[0] / "healthy" / "version_0" / JSONL_NAME
        target.mkdir()
        (target / source.name).write_bytes(source.read_bytes()[:-5])
    code, out, err = _run(["report", str(target)])
    assert code == report_command.EXIT_BAD_INPUT
    assert out == ""
    assert err.startswith("gradwatch report: error: ")
    assert re.search(message, err.strip())


@pytest.mark.slow
def test_plot_without_matplotlib_names_the_extra(
    demo_logdir: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    code, out, err = _run(["report", str(demo_logdir[0]), "--plot", str(tmp_path / "figure.png")])
    assert code == report_command.EXIT_BAD_INPUT
    assert out == ""  # refused before reading anything
    assert "--plot needs matplotlib" in err
    assert "pip install 'gradwatch[plot]'" in err
    assert not (tmp_path / "figure.png").exists()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib (the 'plot' extra)")
def test_plot_writes_a_png(demo_logdir: tuple[Path, str], tmp_path: Path) -> None:
    figure = tmp_path / "rel_error.png"
    code, out, _ = _run(["report", str(demo_logdir[0]), "--plot", str(figure)])
    assert code == report_command.EXIT_FAILURE_RECORDED
    assert f"plot written to {figure}" in out
    assert figure.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert figure.stat().st_size > 10_000


@pytest.mark.slow
def test_console_script_exit_status_gates_ci(demo_logdir: tuple[Path, str]) -> None:
    script = Path(sys.executable).parent / "gradwatch"
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable} (package not installed in this environment)")
    done = subprocess.run([str(script), "report", str(demo_logdir[0] / "rmsnorm")], capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    assert "net.0.weight" in done.stdout


def test_python_dash_m_gradwatch(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["gradwatch", "--version"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("gradwatch", run_name="__main__")
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip().startswith("gradwatch ")


@pytest.mark.slow
def test_command_line_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--bug", "nonsense"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'nonsense'" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_whose_every_check_was_inconclusive_exits_3(tmp_path: Path) -> None:
    (tmp_path / "blind").mkdir()
    record = {"format": "gradwatch-check", "version": 1, "verdict": "inconclusive", "scalars": {}, "failures": []}
    lines = [json.dumps({**record, "step": step}) + "\n" for step in (1, 500, 1000)]
    (tmp_path / "blind" / JSONL_NAME).write_text("".join(lines))
    code, out, _ = _run(["report", str(tmp_path)])
    assert code == report_command.EXIT_NOTHING_CHECKED == 3
    assert "result: NOTHING CHECKED, every check of blind was inconclusive (exit status 3)" in out
