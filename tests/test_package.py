"""Packaging: the public names, the typing marker, and a light import path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gradroute


def test_public_names_exist():
    for name in gradroute.__all__:
        assert getattr(gradroute, name) is not None
    assert not any(name.startswith("_") for name in gradroute.__all__)


def test_py_typed_is_shipped():
    assert (Path(gradroute.__file__).parent / "py.typed").exists()


def test_import_does_not_load_the_cli_or_optional_stacks():
    code = (
        "import sys, gradroute; "
        "bad = [m for m in ('gradroute.__main__', 'gradroute._bench', 'gradroute._demo', 'gradroute._workloads', "
        "'gradroute._demo_models', 'matplotlib', 'diffusers', 'transformers', 'lightning', 'accelerate') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
