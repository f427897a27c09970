"""The examples in ``gradroute.cli``'s docstrings run as written (the supported import paths among them)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import gradroute.cli

MODULES = sorted(m.name for m in pkgutil.walk_packages(gradroute.cli.__path__, "gradroute.cli."))
#: doctest examples (``>>>`` lines) per module that has any; every other module has none
EXAMPLES = {"gradroute.cli": 6, "gradroute.cli.data": 3, "gradroute.cli.models": 12, "gradroute.cli.noise": 3}


@pytest.mark.parametrize("name", ["gradroute.cli", *MODULES])
def test_docstring_examples_run(name):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder().find(importlib.import_module(name), name):
        runner.run(test)
    assert (runner.tries, runner.failures) == (EXAMPLES.get(name, 0), 0)
