"""mkdocs hooks: the site shows the repository's Markdown files that live outside ``docs/``, with their links.

``README.md`` is the home page, ``BENCHMARKS.md`` and ``examples/`` are pages and files of the site, and every
relative link in them or in ``docs/*.md`` that names a file of the repository is rewritten to that file's place
in the site (``../BENCHMARKS.md`` from ``docs/checkpointing.md``, ``docs/distributed.md`` from the README). A
link to a file of the repository that the site does not show (``pyproject.toml``, a script) becomes its text
and the file's path. A link to a file that does not exist is left as it is, so that ``mkdocs build --strict``
reports it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]

#: repository path -> site path, for the files outside docs/ that the site shows
OUTSIDE = {
    "README.md": "index.md",
    "BENCHMARKS.md": "benchmarks.md",
    "examples/README.md": "examples/README.md",
    **{f"examples/{p.name}": f"examples/{p.name}" for p in sorted((ROOT / "examples").glob("*.py"))},
}

_LINK = re.compile(r"(?<!!)\[([^\]\n]*)\]\(([^)\s#]+)((?:#[^)\s]*)?)\)")  # a link, not an image


def on_files(files: Files, config: Any) -> Files:
    for repo_path, site_path in OUTSIDE.items():
        files.append(File.generated(config, site_path, abs_src_path=str(ROOT / repo_path)))
    return files


def site_path(repo_path: str) -> str | None:
    """Where the repository file ``repo_path`` lies in the site, or None if the site does not show it."""
    if repo_path in OUTSIDE:
        return OUTSIDE[repo_path]
    if repo_path.startswith("docs/"):
        return repo_path.removeprefix("docs/")
    return None


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    source = Path(page.file.abs_src_path).resolve().relative_to(ROOT).as_posix()
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match[str]) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("mailto:", "/")):
            return match.group(0)
        repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(source), target))
        if not (ROOT / repo_path).exists():
            return match.group(0)
        text, where = match.group(1), site_path(repo_path)
        if (ROOT / repo_path).is_dir():  # a folder: its README's page, where the site has one
            where, repo_path = site_path(f"{repo_path}/README.md"), f"{repo_path}/"
        if where is None:  # a file or folder of the repository that the site does not show
            return text if f"`{repo_path}`" in text else f"{text} (`{repo_path}`)"
        return f"[{text}]({posixpath.relpath(where, here or '.')}{match.group(3)})"

    return _LINK.sub(rewrite, markdown)
