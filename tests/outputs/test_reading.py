"""Reading a log directory back: the JSON lines record of any logger's run; malformed records are refused with the
path, the line and the reason."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger

from gradwatch import GradWatch
from gradwatch.cli.demo_models import CustomNormClassifier, synthetic_loader
from gradwatch.engine.results.rendering import ordered_failures
from gradwatch.errors import ReportInputError
from gradwatch.outputs.jsonl import JSONL_NAME
from gradwatch.outputs.reading import read_jsonl, read_logdir

CULPRIT = "the backward of `net[1]` (`RMSNorm`) is wrong"


@pytest.fixture(scope="module")
def csv_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GradWatch]:
    """A Lightning run with a CSVLogger only and a planted backward bug (the demo's RMSNorm), checked every step."""
    logdir = tmp_path_factory.mktemp("csv")
    pl.seed_everything(0, verbose=False)
    watch = GradWatch(every_n_steps=1, max_overhead=None)
    trainer = pl.Trainer(
        logger=CSVLogger(str(logdir)), callbacks=[watch], max_steps=2, accelerator="cpu", devices=1,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(CustomNormClassifier(correct_backward=False), synthetic_loader())
    return logdir, watch


@pytest.mark.slow
def test_a_csv_logger_run_is_recorded_and_read_back(csv_run: tuple[Path, GradWatch]) -> None:
    logdir, watch = csv_run
    (record,) = logdir.rglob(JSONL_NAME)
    assert record.parent == logdir / "lightning_logs" / "version_0"  # beside metrics.csv
    assert (record.parent / "metrics.csv").exists()
    (run,) = read_logdir(logdir)
    assert [c.step for c in run.checks] == [r.step for r in watch.recomputed_reports] == [1, 2]
    assert [c.verdict for c in run.checks] == ["fail", "fail"]
    assert [(f.step, f.kind, f.tensor, f.analytic, f.numeric) for f in run.failures] == [
        (r.step, p.kind, p.target or "(the model)", p.analytic, p.numeric)
        for r in watch.recomputed_reports
        for p in ordered_failures(r)
    ]  # every failing probe, at full precision
    assert all(CULPRIT in message for message in run.culprits.values())
    assert list(run.culprits) == [1, 2]


@pytest.mark.slow
def test_gradwatch_report_on_a_csv_logger_run_names_the_culprit_and_exits_1(csv_run: tuple[Path, GradWatch]) -> None:
    logdir, _ = csv_run
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "gradwatch", "report", str(logdir)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 1, done.stderr
    assert f"culprit at step 1: {CULPRIT}" in done.stdout
    assert "result: FAIL, gradient failures recorded in lightning_logs/version_0 (exit status 1)" in done.stdout
    assert "Traceback" not in done.stderr


def _line(**changes: Any) -> str:
    record = {"format": "gradwatch-check", "version": 1, "step": 3, "verdict": "ok", "scalars": {}, "failures": []}
    record.update(changes)
    return json.dumps({k: v for k, v in record.items() if v is not ...})


BAD_LINES = {
    "not-json": ("{not json\n", r"line 2 is not JSON"),
    "not-utf8": (b'{"step": "\xff"}\n', r"line 2 is not UTF-8"),
    "cut-short": (_line(), r"line 2 is cut short \(no newline\)"),
    "other-format": (_line(format="something") + "\n", r"line 2: not a gradwatch check record"),
    "future-version": (_line(version=2) + "\n", r"line 2: record version 2"),
    "bad-verdict": (_line(verdict="great") + "\n", r"line 2: 'verdict' is 'great' \(expected one of ok, inconclusive"),
    "negative-step": (_line(step=-1) + "\n", r"line 2: 'step' is -1"),
    "bool-step": (_line(step=True) + "\n", r"line 2: 'step' is True"),
    "nan-verdict-scalar": (
        _line(scalars={"gradwatch/verdict": "nan"}) + "\n",
        r"line 2: the gradwatch/verdict scalar nan contradicts the verdict 'ok'",
    ),
    "text-number": (
        _line(scalars={"gradwatch/rel_error_max": "big"}) + "\n",
        r"line 2: scalar 'gradwatch/rel_error_max' is 'big', not a number",
    ),
    "bad-failure": (_line(failures=[{"kind": "param"}]) + "\n", r"line 2: 'target' is None"),
    "bad-index": (
        _line(failures=[{"kind": "param", "target": "w", "index": ["a"], "analytic": 1, "numeric": 2}]) + "\n",
        r"line 2: a failure's index is \['a'\]",
    ),
    "lone-surrogate": (_line(culprit="\ud800") + "\n", r"line 2: 'culprit' is not valid Unicode"),
    "deep": ("[" * 100_000 + "]" * 100_000 + "\n", r"line 2 (is nested too deeply|: not a gradwatch check record)"),
}


@pytest.mark.parametrize(("content", "message"), BAD_LINES.values(), ids=BAD_LINES.keys())
def test_a_malformed_record_is_refused_with_path_line_and_reason(
    tmp_path: Path, content: str | bytes, message: str
) -> None:
    path = tmp_path / JSONL_NAME
    good = (_line(step=1) + "\n").encode()
    path.write_bytes(good + (content.encode("utf-8", "surrogatepass") if isinstance(content, str) else content))
    with pytest.raises(ReportInputError, match=rf"^{re.escape(str(path))}: {message}") as raised:
        read_jsonl(path)
    assert "\n" not in str(raised.value)


def test_a_line_longer_than_the_bound_is_refused_without_reading_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gradwatch.outputs import reading

    monkeypatch.setattr(reading, "MAX_LINE_BYTES", 1000)
    path = tmp_path / JSONL_NAME
    path.write_text(_line(notes=["x" * 5000]) + "\n")
    with pytest.raises(ReportInputError, match=r"line 1 is longer than 1000 bytes"):
        read_jsonl(path)
