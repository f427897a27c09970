"""Packaging: the public names, the version, the typing marker in the wheel, the console script, a light import."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import gradroute

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _fresh(code: str) -> str:
    """Run ``code`` in a fresh interpreter (nothing imported yet); its stdout."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_all_lists_exactly_the_public_names_and_each_resolves():
    # in a fresh process: the tests import gradroute.cli, which then shows up as an attribute of the package
    public = json.loads(
        _fresh("import json, gradroute; print(json.dumps(sorted(n for n in vars(gradroute) if not n.startswith('_'))))")
    )
    assert sorted(gradroute.__all__) == public
    assert len(set(gradroute.__all__)) == len(gradroute.__all__)
    namespace: dict = {}
    exec("from gradroute import *", namespace)
    assert {n for n in namespace if n != "__builtins__"} == set(gradroute.__all__)


def test_version_is_pyproject_version():
    assert gradroute.__version__ == PYPROJECT["project"]["version"]


def test_py_typed_is_in_the_wheel():
    # hatchling is not installed offline here: check what the wheel target takes instead of building it
    wheel = PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert "src/gradroute" in wheel["packages"]
    assert not {"only-include", "exclude", "sources"} & set(wheel), "a filter may drop py.typed"
    assert (ROOT / "src" / "gradroute" / "py.typed").is_file()
    if (ROOT / ".git").exists():  # hatch leaves out what git ignores
        ignored = subprocess.run(["git", "check-ignore", "-q", "src/gradroute/py.typed"], cwd=ROOT, check=False)
        assert ignored.returncode == 1
    assert "Typing :: Typed" in PYPROJECT["project"]["classifiers"]


def test_console_script_resolves_to_the_cli():
    target = PYPROJECT["project"]["scripts"]["gradroute"]
    module, _, attr = target.partition(":")
    main = getattr(importlib.import_module(module), attr)
    assert main(["demo", "--help"]) == 0


def test_python_dash_m_gradroute_runs_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "gradroute", "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and "{demo,bench}" in out.stdout, out.stderr


def test_import_does_not_load_the_cli_or_optional_stacks():
    loaded = _fresh(
        "import sys, gradroute; "
        "print([m for m in sys.modules if m == 'gradroute.__main__' or m.startswith(('gradroute.cli', 'matplotlib', "
        "'diffusers', 'transformers', 'lightning', 'accelerate'))])"
    )
    assert loaded.strip() == "[]"
