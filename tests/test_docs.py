"""The README's code blocks and the public docstrings' examples run as written."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

import gradroute

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_readme_blocks_run_in_order():
    blocks = python_blocks(ROOT / "README.md")
    assert len(blocks) >= 3
    namespace: dict = {}
    # the first block is the problem statement (it shows the crash); the rest form one program
    for block in blocks[1:]:
        exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["stats"] is not None


def test_readme_problem_statement_is_what_the_api_says():
    first = python_blocks(ROOT / "README.md")[0]
    assert "router.backward(tenc=loss_tenc, unet=loss_unet)" in first
    assert "make demo" in (ROOT / "README.md").read_text() and "make test" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("name", sorted(gradroute.__all__))
def test_public_docstring_examples(name):
    obj = getattr(gradroute, name)
    finder = doctest.DocTestFinder(recurse=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(obj, name, globs={"gradroute": gradroute}):
        runner.run(test)
    assert runner.failures == 0
