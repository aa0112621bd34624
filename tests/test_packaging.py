"""The package as the index shows it: metadata that is complete and true, and a source distribution whose tests run.

``python -m build`` and ``twine check dist/*`` are the release's own commands (they need the network for the build's
isolated environment); these tests read ``pyproject.toml`` and build the source distribution with the installed
setuptools, offline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_license_is_an_spdx_expression_with_its_file() -> None:
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    # PEP 639: a license expression supersedes the license classifiers (setuptools refuses both)
    assert not [c for c in PROJECT["classifiers"] if c.startswith("License ::")]


def test_the_classifiers_are_true() -> None:
    classifiers = PROJECT["classifiers"]
    assert "Framework :: Pytest" not in classifiers  # gradwatch is no pytest plugin: it registers no entry point
    assert "pytest11" not in (ROOT / "pyproject.toml").read_text()
    versions = {c.rsplit(" ", 1)[-1] for c in classifiers if c.startswith("Programming Language :: Python :: 3.")}
    assert versions == {"3.10", "3.11", "3.12", "3.13"}
    assert PROJECT["requires-python"] == ">=3.10"
    assert "Typing :: Typed" in classifiers
    assert (ROOT / "gradwatch" / "py.typed").exists()


def test_the_project_urls_are_given() -> None:
    urls = PROJECT["urls"]
    assert {"Homepage", "Documentation", "Repository", "Issues", "Changelog"} <= set(urls)
    assert all(url.startswith("https://") for url in urls.values())


def test_the_extras_are_named_for_the_integrations_they_serve() -> None:
    extras = PROJECT["optional-dependencies"]
    assert {"huggingface", "deepspeed", "test", "docs", "plot"} <= set(extras)
    names = {extra: {r.split(">")[0].split(";")[0].strip() for r in extras[extra]} for extra in extras}
    assert {"transformers", "accelerate"} <= names["huggingface"]
    assert names["deepspeed"] == {"deepspeed"}
    assert "ruff" in names["docs"]  # mkdocstrings formats the API reference's signatures with it


@pytest.mark.slow
@pytest.mark.slow
def test_the_source_distribution_holds_the_whole_test_suite_and_what_it_reads(tmp_path: Path) -> None:
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr
    name = done.stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / name) as sdist:
        members = {Path(*Path(m).parts[1:]).as_posix() for m in sdist.getnames()}
    wanted = {
        path.relative_to(ROOT).as_posix()
        for folder in ("tests", "docs", "examples")
        for path in (ROOT / folder).rglob("*")
        if path.is_file() and path.suffix in {".py", ".md", ".png", ".css"} and "__pycache__" not in path.parts
    }
    wanted |= {"README.md", "CHANGELOG.md", "LICENSE", "mkdocs.yml", "constraints.txt", "pyproject.toml"}
    assert wanted - members == set()
    assert not [m for m in members if "__pycache__" in m or m.endswith(".pyc")]
