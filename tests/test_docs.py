"""The examples run as written: README.md's and docs/*.md's python blocks, and every public name's docstring.

Each count below is exact, so that an example that stops being found (a renamed fence, a docstring rewritten
without its example) fails here instead of silently running nothing. A python block that cannot run (a
fragment with undefined names, a script for torchrun) says so with ``<!-- not run: why -->`` on the line above
its fence and is counted apart.
"""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

import gradroute

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

#: python blocks executed, per file (in order, one namespace per file)
BLOCKS_RUN = {
    "README.md": 2,
    "docs/api.md": 0,  # generated from the docstrings, whose examples test_public_docstring_examples_run runs
    "docs/checkpointing.md": 1,
    "docs/compile.md": 1,
    "docs/design.md": 0,
    "docs/distributed.md": 0,
    "docs/integrations.md": 0,  # excerpts of scripts that tests/integration runs (and checks them against)
    "docs/plan.md": 0,
    "docs/static_graphs.md": 2,
    "docs/training_step.md": 1,
    "docs/versions.md": 0,
}
#: python blocks marked ``<!-- not run: ... -->``, per file
BLOCKS_NOT_RUN = {
    "README.md": 1,
    "docs/api.md": 0,
    "docs/checkpointing.md": 0,
    "docs/compile.md": 0,
    "docs/design.md": 0,
    "docs/distributed.md": 1,
    "docs/integrations.md": 6,
    "docs/plan.md": 0,
    "docs/static_graphs.md": 0,
    "docs/training_step.md": 0,
    "docs/versions.md": 0,
}
#: doctest examples (``>>>`` lines) executed per public name, its methods and, for a module, its functions
DOCTEST_EXAMPLES = {
    "Autotune": 7,
    "Call": 5,
    "CompileStats": 6,
    "GraphCounts": 5,
    "GraphFreedError": 5,
    "GroupStats": 9,
    "Plan": 5,
    "Group": 4,
    "PlanOptions": 4,
    "Router": 13,
    "StepStats": 7,
    "checkpoint": 8,
    "checkpoint_modules": 5,
    "compile": 7,
    "compile_stats": 5,
    "cut_points": 6,
    "enable_checkpointing": 5,
    "schedules": 7,
}

_FENCE = re.compile(r"(<!-- not run:[^\n]*-->\n)?```python\n(.*?)```", flags=re.S)


def python_blocks(path: Path) -> list[tuple[bool, str]]:
    """``(runs, code)`` for each python block of a Markdown file, in order."""
    return [(not marker, code) for marker, code in _FENCE.findall(path.read_text())]


def test_every_markdown_file_is_counted():
    assert sorted(BLOCKS_RUN) == DOCS and sorted(BLOCKS_NOT_RUN) == DOCS
    for doc in DOCS:
        runs = [r for r, _ in python_blocks(ROOT / doc)]
        assert (runs.count(True), runs.count(False)) == (BLOCKS_RUN[doc], BLOCKS_NOT_RUN[doc]), doc


@pytest.mark.parametrize("doc", DOCS)
def test_markdown_python_blocks_run_in_order(doc, capsys):
    namespace: dict = {"__name__": doc}
    executed = 0
    for runs, code in python_blocks(ROOT / doc):
        if runs:
            exec(compile(code, doc, "exec"), namespace)
            executed += 1
    assert executed == BLOCKS_RUN[doc]
    if doc == "README.md":  # the README's blocks form one program that ends with a training step
        assert namespace["stats"] is not None and namespace["stats"].step == 4
    if doc == "docs/static_graphs.md":  # followed from the third backward on; a changed graph refused untouched
        out = capsys.readouterr().out
        counts = "GraphCounts(walked=2, followed=2, planned=1, plain=0)\n"
        assert counts + "`static_graph` was set, but the autogr\nTrue\n" in out
        assert "autotune: candidate #" in out
    if doc == "docs/compile.md":  # gradroute.compile compiled the UNet's backward and its variants
        assert namespace["stats"].backwards == 1 and namespace["stats"].variants >= 2
    if doc == "docs/training_step.md":  # a whole training loop, resumable: it ends where its prose says
        stats = namespace["stats"]
        assert stats.step == namespace["total_steps"] and not stats.accumulating
        assert 0 < namespace["scheduler_tenc"].last_epoch <= namespace["total_steps"]
        assert set(namespace["checkpoint"]["router"]["optimizers"]) == {"tenc", "unet"}
        assert "0 {" in capsys.readouterr().out


def test_readme_problem_statement_is_what_the_api_says():
    runs, first = python_blocks(ROOT / "README.md")[0]
    assert not runs
    assert "router.backward(tenc=loss_tenc, unet=loss_unet)" in first
    assert "make demo" in (ROOT / "README.md").read_text() and "make test" in (ROOT / "README.md").read_text()


def test_every_public_name_is_counted():
    # every public name has a runnable example: a new name fails here until its example is counted
    assert set(gradroute.__all__) == set(DOCTEST_EXAMPLES)
    assert all(DOCTEST_EXAMPLES.values())


def _run_docstring_examples(name: str) -> tuple[int, int]:
    """``(examples executed, failures)`` of the docstrings of ``gradroute.<name>`` and what it contains."""
    finder = doctest.DocTestFinder(recurse=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(getattr(gradroute, name), name, globs={"gradroute": gradroute}):
        runner.run(test)
    return runner.tries, runner.failures


@pytest.mark.parametrize("name", sorted(DOCTEST_EXAMPLES))
def test_public_docstring_examples_run(name):
    assert _run_docstring_examples(name) == (DOCTEST_EXAMPLES[name], 0)


def test_api_reference_shows_every_public_name():
    shown = re.findall(r"^::: gradroute\.(\w+)$", (ROOT / "docs/api.md").read_text(), flags=re.M)
    assert sorted(shown) == sorted(set(shown)) == sorted(gradroute.__all__)


_NOTE = re.compile(r"\s*(?:# )?NOTE \[(.+)\]\s*")  # a NOTE's title line: alone on its line, in a comment or not
_INDEX_ROW = re.compile(r"^\| (.+) \| `(.+)` \|$", flags=re.M)


def note_blocks() -> list[tuple[str, str]]:
    """``(title, file under src/gradroute/)`` of every NOTE block in the sources (mentions in a sentence aside)."""
    src = ROOT / "src" / "gradroute"
    return [
        (m.group(1), path.relative_to(src).as_posix())
        for path in sorted(src.rglob("*.py"))
        for line in path.read_text().splitlines()
        if (m := _NOTE.fullmatch(line))
    ]


def test_design_doc_indexes_every_note_block():
    notes = note_blocks()
    index = (ROOT / "docs/design.md").read_text().split("## Index of NOTE blocks", 1)[1]
    listed = _INDEX_ROW.findall(index)
    assert len({title for title, _ in notes}) == len(notes), "two NOTE blocks with one title"
    expected = "\n".join(f"| {title} | `{file}` |" for title, file in notes)
    assert sorted(listed) == sorted(notes), f"docs/design.md's NOTE index should read:\n{expected}"


def _matrix_table(text: str) -> list[str]:
    """The rows of the supported-versions table (lines starting with ``| 2.``) of a Markdown text."""
    return [line for line in text.splitlines() if line.startswith("| 2.")]


def test_versions_page_has_a_row_per_supported_minor_between_the_matrix_markers():
    # `make test-matrix` rewrites the table between the markers of docs/versions.md (the README links to it)
    text = (ROOT / "docs/versions.md").read_text()
    marked = text[text.index("<!-- torch-matrix:start -->") : text.index("<!-- torch-matrix:end -->")]
    minors = {".".join(row.split("|")[1].strip().split(".")[:2]) for row in _matrix_table(marked)}
    assert {f"2.{k}" for k in range(4, 16)} <= minors


@pytest.mark.parametrize("name", sorted(DOCTEST_EXAMPLES))
def test_public_docstrings_title_their_examples_section_examples(name):
    # the API reference renders a Google-style "Examples:" section as code; "Example:" would be a note whose
    # ">>>" lines run together as text (and whose `x[0](y)` reads as a Markdown link)
    finder = doctest.DocTestFinder(recurse=True, exclude_empty=False)
    for test in finder.find(getattr(gradroute, name), name, globs={}):
        assert not re.search(r"^\s*Example:\s*$", test.docstring or "", flags=re.M), test.name
