"""``gradwatch report`` never hides a failure: a run whose only failure is an applied check, followed at the same
step by the clip coefficient's ok check, exits 1 and lists both, each with its own verdict. The records are written
the way the Hugging Face callback writes them (:func:`gradwatch.integrations.huggingface.run_sinks`): the JSON lines
record, and the scalars through ``trainer.log``, which the Trainer's TensorBoard callback writes as ``train/<tag>`` at
the step; read from the record, whether or not the event files lie beside it."""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import pytest
import torch
from loop_models import MLP, classification_batches, cross_entropy, plant_bug
from torch.utils.tensorboard import SummaryWriter

from gradwatch import GradientWatch
from gradwatch.cli import main
from gradwatch.outputs.jsonl import JSONL_NAME
from gradwatch.outputs.sinks import JsonLinesSink, LogCallSink, Sink
from gradwatch.tensorboard.writer import TRAINER_PREFIX

pytestmark = pytest.mark.slow


def _train(sinks: list[Sink], steps: int = 2) -> GradientWatch:
    """Applied checks only (as a Trainer run whose recomputed checks all passed would show none failing), of a model
    whose backward is wrong, the loop clipping by norm: at each step an applied failure and the clip check's ok."""
    watch = GradientWatch(
        every_n_steps=10_000,
        max_overhead=None,
        first_check_step=None,
        applied_every_n_steps=1,
        sinks=sinks,
        on_fail=lambda r: None,
    )
    torch.manual_seed(0)
    model = MLP()
    plant_bug(model.layers[3])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step, batch in enumerate(classification_batches(steps), start=1):
        watch.record(batch, model=model, step=step)
        cross_entropy(model, batch).backward()
        watch.before_optimizer_step(model, cross_entropy, step=step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        watch.after_clipping(model, 0.1, step=step)
        optimizer.step()
        optimizer.zero_grad()
    return watch


def _report(logdir: Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["report", str(logdir)])
    return code, out.getvalue()


@pytest.mark.parametrize("written", ["jsonl", "both"])
def test_an_applied_failure_sharing_its_step_with_the_clip_check_exits_1_and_is_listed(
    written: str, tmp_path: Path
) -> None:
    sinks: list[Sink] = [JsonLinesSink(tmp_path / JSONL_NAME)]
    writer = None
    if written == "both":
        writer = SummaryWriter(str(tmp_path))

        def trainer_log(values: dict[str, float | str], step: int) -> None:  # TensorBoardCallback.on_log
            for tag, value in values.items():
                if isinstance(value, float):
                    writer.add_scalar(TRAINER_PREFIX + tag, value, step)

        sinks.append(LogCallSink(trainer_log))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        watch = _train(sinks)
    if writer is not None:
        writer.close()
    kinds = [(r.step, r.verdict, r.fault) for r in watch.reports if r.scope != "update"]  # the update's: its own
    assert [(r.step, r.verdict) for r in watch.update_reports] == [
        (1, "ok"),
        (2, "ok"),
    ]  # the clip declared by after_clipping
    assert kinds == [(1, "fail", kinds[0][2]), (1, "ok", None), (2, "fail", kinds[2][2]), (2, "ok", None)], kinds
    assert kinds[0][2] not in (None, "clipping")
    code, out = _report(tmp_path)
    assert code == 1, out
    assert "2 fail" in out.split("applied checks (the gradient the optimizer applied):")[1].splitlines()[0], out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1] in "12" and "fail" in line.split()]
    assert [row[:3] for row in rows if row[1] == "gradient"] == [["1", "gradient", "fail"], ["2", "gradient", "fail"]]
    ok_rows = [line.split()[:4] for line in out.splitlines() if "clip coefficient" in line]
    assert ok_rows == [["1", "clip", "coefficient", "ok"], ["2", "clip", "coefficient", "ok"]], out
    assert f"{kinds[0][2]} fault at step 1" in out
