"""What the README and the guide quote, checked against the code: defaults, option names, exit statuses, the sample
failure, the set-up commands CI runs and the links between the pages.

The documentation site itself is built in strict mode by ``.ci/run`` (``mkdocs build --strict``), which fails on a
broken link or an API object that does not exist.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import gradwatch
import gradwatch.cli.demo
import gradwatch.cli.reporting
from gradwatch import GradientWatch, GradWatch
from gradwatch.engine.results.rendering import render_text
from gradwatch.engine.settings import ProbeSettings

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
GUIDE = (ROOT / "docs" / "guide.md").read_text()

TEST_COMMAND = 'pip install -c constraints.txt torch==2.13.0 -e ".[test]" && python -m pytest tests -m "not slow"'
DEMO_COMMAND = "pip install torch==2.13.0 -e . && gradwatch demo"


def test_the_readme_is_a_five_minute_read() -> None:
    assert len(README.splitlines()) <= 200


def test_the_readme_keeps_the_test_command_ci_runs() -> None:
    # .ci/run takes the first line starting with "pip install" after the marker and runs it
    after_marker = README.split("<!-- test-command -->", 1)[1]
    command = next(line for line in after_marker.splitlines() if line.startswith("pip install"))
    assert command == TEST_COMMAND


def test_the_readme_keeps_the_demo_command() -> None:
    assert DEMO_COMMAND in README


def _options_table() -> list[tuple[str, str, str]]:
    """(option, default, what it does) of each row of the README's "options at a glance" table."""
    table = README.split("<!-- options-table", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    return [(name.strip("`"), default.strip("`"), what) for name, default, what, *_ in cells]


OPTIONS = _options_table()
SIGNATURE = inspect.signature(GradientWatch.__init__).parameters  # GradWatch passes its options on to the watch


def _shown(value: object) -> str:
    """How the table's text writes a value in effect: a fraction as a percentage, a number as it is."""
    if isinstance(value, float) and 0 < value < 1:
        return f"{value * 100:g}%"
    return str(value)


def test_the_options_table_is_found() -> None:
    assert len(OPTIONS) >= 8


@pytest.mark.parametrize(("name", "default", "what"), OPTIONS, ids=[name for name, _, _ in OPTIONS])
def test_each_option_at_a_glance_is_an_argument_of_gradwatch_with_that_default(
    name: str, default: str, what: str
) -> None:
    # an argument of the watch's own, or a probe option (``**options``, the fields of ProbeSettings)
    assert name in SIGNATURE or name in ProbeSettings.option_names()
    quoted = ast.literal_eval(default)
    resolved = getattr(GradWatch(), name)
    if name in SIGNATURE:  # the default the signature (and the API reference) shows
        assert quoted == SIGNATURE[name].default
    else:  # a probe option: the value GradWatch() probes with
        assert quoted == resolved
    if resolved != quoted:  # a default that stands for another value (None: every 500 steps) says which
        assert _shown(resolved) in what, f"the row of {name} should say what {default} means: {resolved}"


def test_the_guide_quotes_the_default_probe_batch_size() -> None:
    quoted = re.search(r"`probe_batch_size` \(default (\d+)", GUIDE)
    assert quoted is not None
    assert int(quoted[1]) == GradWatch().probe_batch_size


def _exit_statuses(text: str, start: str) -> list[int]:
    """The bold numbers of the paragraph that begins at ``start``."""
    paragraph = start + text.split(start, 1)[1].split("\n\n", 1)[0]
    return [int(n) for n in re.findall(r"\*\*(\d)\*\*", paragraph)]


EXIT_STATUSES = sorted(
    value
    for name, value in vars(gradwatch.cli.reporting).items()
    if name.startswith("EXIT_") and isinstance(value, int)
)


@pytest.mark.parametrize(
    ("text", "start"),
    [(README, "`gradwatch report` exits with"), (GUIDE, "Exit status: **0**")],
    ids=["readme", "guide"],
)
def test_every_exit_status_of_gradwatch_report_is_documented(text: str, start: str) -> None:
    assert _exit_statuses(text, start) == EXIT_STATUSES


def _sample_failure() -> list[str]:
    """The README's sample failure: the headline (wrapped) joined into one line, then the other lines."""
    block = README.split("## When a check fails", 1)[1].split("```\n", 2)[1]
    lines = block.splitlines()
    rest = next(i for i, line in enumerate(lines) if line.startswith("  "))
    return [" ".join(lines[:rest]), *lines[rest:]]


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _skeleton(line: str) -> tuple[str, list[float]]:
    """A line's text with its numbers taken out, and the numbers; a probe's noise estimate (round-off, which another
    CPU's kernels may change) is left out altogether."""
    line = re.sub(r"\(± [^)]*\)", "(± noise)", line)
    return _NUMBER.sub("N", line), [float(n) for n in _NUMBER.findall(line)]


def test_the_sample_failure_is_the_warning_the_demo_raises(tmp_path: Path) -> None:
    reports, _ = gradwatch.cli.demo.train(
        gradwatch.cli.demo.RUNS["rmsnorm"], tmp_path, steps=1, every=50, progress_bar=False
    )
    warning = render_text(reports[0]).splitlines()
    sample = _sample_failure()
    assert len(sample) == len(warning)
    for quoted, printed in zip(sample, warning, strict=True):
        (quoted_text, quoted_numbers), (printed_text, printed_numbers) = _skeleton(quoted), _skeleton(printed)
        assert quoted_text == printed_text
        assert quoted_numbers == pytest.approx(printed_numbers, rel=1e-3)


def _slug(heading: str) -> str:
    """The anchor of a Markdown heading, as GitHub and MkDocs' toc both make it for plain headings."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


# The README is the package index's long description too, where a relative link leads nowhere: each of its links is
# absolute, to the documentation site or to a file of the repository, both written once, in pyproject.toml
URLS = dict(re.findall(r'^(\w+) = "(https://[^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE))
DOCS_SITE, REPOSITORY = URLS["Documentation"], URLS["Repository"]
LINKS = sorted(set(re.findall(r"\]\(([^)\s]+)\)", README)) - {""})


def _file_of(url: str) -> Path | None:
    """The file of this checkout a README link shows: a page (or file) of the docs site, a file of the repository."""
    if url.startswith(DOCS_SITE):
        page = url[len(DOCS_SITE) :].strip("/")
        if "." in page.rsplit("/", 1)[-1]:  # a file the site copies as it is (dashboard.png)
            return ROOT / "docs" / page
        return ROOT / "docs" / f"{page or 'index'}.md"
    if url.startswith(f"{REPOSITORY}/blob/main/"):
        return ROOT / url[len(f"{REPOSITORY}/blob/main/") :]
    return None


def test_the_sites_address_is_the_one_the_package_metadata_gives() -> None:
    assert DOCS_SITE.endswith("/")
    site_url = re.search(r"^site_url: (\S+)", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)
    assert site_url is not None
    assert site_url[1] == DOCS_SITE


def test_the_readme_links_to_the_site_and_the_repository() -> None:
    assert len(LINKS) >= 10
    assert any(link.startswith(DOCS_SITE) for link in LINKS)


@pytest.mark.parametrize("link", LINKS, ids=str)
def test_each_link_of_the_readme_leads_to_a_file_and_heading_that_exist(link: str) -> None:
    url, _, anchor = link.partition("#")
    path = _file_of(url)
    assert path is not None, f"{link}: neither the docs site ({DOCS_SITE}) nor the repository ({REPOSITORY})"
    assert path.exists()
    if anchor:
        assert anchor in _anchors(path)


def test_every_page_of_the_docs_is_in_the_sites_navigation() -> None:
    nav = set(re.findall(r"^\s+- [^:]+: (\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.MULTILINE))
    pages = {path.relative_to(ROOT / "docs").as_posix() for path in (ROOT / "docs").rglob("*.md")}
    assert pages <= nav, f"add these pages to the nav of mkdocs.yml: {sorted(pages - nav)}"


def test_the_sites_hook_turns_sphinx_roles_into_optional_cross_references() -> None:
    namespace: dict[str, object] = {}
    exec((ROOT / "docs" / "hooks.py").read_text(), namespace)
    html = "see :class:<code>~gradwatch.CheckReport</code> and :func:<code>gradwatch.check_gradients</code>"
    assert namespace["on_page_content"](html) == (  # type: ignore[operator]
        'see <autoref identifier="gradwatch.CheckReport" optional><code>CheckReport</code></autoref> and '
        '<autoref identifier="gradwatch.check_gradients" optional><code>gradwatch.check_gradients</code></autoref>'
    )


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IMPORTS = sorted(
    {
        (module, name.strip())
        for path in DOCS
        for module, names in re.findall(r"^\s*from (gradwatch[\w.]*) import ([\w, ]+)$", path.read_text(), re.MULTILINE)
        for name in names.split(",")
    }
)


def test_the_docs_import_something_from_gradwatch() -> None:
    assert ("gradwatch", "GradWatch") in IMPORTS


@pytest.mark.parametrize(("module", "name"), IMPORTS, ids=[f"{m}.{n}" for m, n in IMPORTS])
def test_each_import_the_docs_show_works(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name)


def test_the_api_reference_has_an_entry_for_each_name_gradwatch_exports() -> None:
    # docs/api.md lists the exports one by one, in the order a user reads them (the loop adapters first)
    entries = set(re.findall(r"^::: gradwatch\.(\w+)\s*$", (ROOT / "docs" / "api.md").read_text(), re.MULTILINE))
    assert set(gradwatch.__all__) <= entries, f"add to docs/api.md: {sorted(set(gradwatch.__all__) - entries)}"
