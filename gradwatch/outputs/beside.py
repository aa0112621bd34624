"""Where the record of a Weights & Biases or MLflow run sits: beside the run's folder, not inside it.

W&B and MLflow keep a run in a folder of their own (``wandb/run-<time>-<id>``, ``mlruns/<experiment>/<run id>``) that
gradwatch does not write into (W&B uploads what lands there, MLflow's may be on a server). The adapters write that run's
``gradwatch.jsonl`` into ``gradwatch_records/<logger>-...-<run id>/`` under the training's own root folder (Lightning's
``default_root_dir``, a Trainer's ``output_dir``), where ``gradwatch report`` pointed at the run's folder finds it: in a
``gradwatch_records`` folder of one of the run folder's ancestors or of their sub-folders (``./wandb/run-...`` and
``./outputs/gradwatch_records/...``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gradwatch.outputs.jsonl import JSONL_NAME

RECORDS_DIR = "gradwatch_records"
"""The folder, under a training's root folder, holding one folder per W&B or MLflow run, named ``...-<run id>``."""

ANCESTORS = 4
"""How many folders up from a run's folder the record is looked for (``save_dir/mlruns/<experiment>/<run>`` is four
below the root folder beside ``save_dir``)."""

_WANDB_RUN = re.compile(r"^(?:offline-)?run-\d{8}_\d{6}-(?P<id>[A-Za-z0-9]+)$")
_MLFLOW_RUN = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class ToolRun:
    """The folder of one run of a tracking tool, and its run id."""

    tool: str
    """``"Weights & Biases"`` or ``"MLflow"``."""
    run_id: str
    path: Path


def record_directory(root: Path, logger: str, run_id: str) -> Path:
    """Where an adapter writes the record of the W&B or MLflow run ``run_id`` logged by ``logger`` (a name such as
    ``WandbLogger-project``): ``root/gradwatch_records/<logger>-<run id>``, characters other than letters, digits,
    ``.``, ``_`` and ``-`` replaced by ``_``."""
    return root / RECORDS_DIR / re.sub(r"[^A-Za-z0-9._-]", "_", f"{logger}-{run_id}")


def _wandb_run(path: Path) -> ToolRun | None:
    match = _WANDB_RUN.match(path.name)
    if match is None or not ((path / "files").is_dir() or any(path.glob("*.wandb"))):
        return None
    return ToolRun("Weights & Biases", match.group("id"), path)


def _mlflow_run(path: Path) -> ToolRun | None:
    if not (_MLFLOW_RUN.match(path.name) and (path / "meta.yaml").is_file() and (path.parent / "meta.yaml").is_file()):
        return None
    if not any((path / part).is_dir() for part in ("metrics", "params", "tags", "artifacts")):
        return None
    return ToolRun("MLflow", path.name, path)


def _run(path: Path) -> ToolRun | None:
    return _wandb_run(path) or _mlflow_run(path)


def _subfolders(path: Path) -> list[Path]:
    try:
        return sorted(child for child in path.iterdir() if child.is_dir())
    except OSError:
        return []


def tool_runs(path: Path) -> list[ToolRun]:
    """The W&B or MLflow runs ``path`` is, or holds two levels down at most (a ``wandb`` folder, an MLflow experiment
    or ``mlruns``); a link (``wandb/latest-run``) is followed."""
    path = path.resolve()
    run = _run(path)
    if run is not None:
        return [run]
    found = []
    for child in _subfolders(path):
        run = _run(child)
        if run is not None:
            found.append(run)
        elif (child / "meta.yaml").is_file():  # an MLflow experiment under mlruns
            found += [run for grandchild in _subfolders(child) if (run := _mlflow_run(grandchild)) is not None]
    return found


def searched(run: ToolRun) -> list[Path]:
    """The ``gradwatch_records`` folders where the record of ``run`` may be, nearest first."""
    folders: list[Path] = []
    for ancestor in list(run.path.parents)[:ANCESTORS]:
        folders.append(ancestor / RECORDS_DIR)
        folders += [child / RECORDS_DIR for child in _subfolders(ancestor) if (child / RECORDS_DIR).is_dir()]
    return folders


def records_beside(run: ToolRun) -> list[Path]:
    """The records of ``run`` beside its folder: ``gradwatch.jsonl`` in a ``...-<run id>`` folder of one of the
    :func:`searched` folders."""
    found = []
    for folder in searched(run):
        found += [
            child / JSONL_NAME
            for child in _subfolders(folder)
            if child.name.endswith("-" + run.run_id) and (child / JSONL_NAME).is_file()
        ]
    return found
