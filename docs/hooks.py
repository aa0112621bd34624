"""MkDocs hook: the reStructuredText roles of gradwatch's docstrings as links of the API reference.

The docstrings are written for both ``help()`` and the site, with Sphinx roles such as :class:`~gradwatch.CheckReport`.
Markdown renders one as ``:class:<code>~gradwatch.CheckReport</code>``; this hook turns it into a cross-reference that
mkdocs-autorefs resolves when the object is in the API reference, and into plain code when it is not (``optional``: an
internal name is no broken link). A literal block's ``Example::`` loses its second colon.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):<code>(?P<tilde>~?)(?P<target>[\w.]+)(?:\(\))?</code>")
_LITERAL_BLOCK = re.compile(r"(\w)::</p>")


def _autoref(match: re.Match[str]) -> str:
    target = match["target"]
    title = target.rsplit(".", 1)[-1] if match["tilde"] else target
    return f'<autoref identifier="{target}" optional><code>{title}</code></autoref>'


def on_page_content(html: str, **kwargs: Any) -> str:
    return _LITERAL_BLOCK.sub(r"\1:</p>", _ROLE.sub(_autoref, html))
