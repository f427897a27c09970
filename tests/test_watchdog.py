"""The suite's hang watchdog (NOTE [A hung test ends the run with every thread's stack] in conftest.py).

A test that holds the GIL while it blocks (a C call made through ``ctypes.PyDLL``, which keeps it) is what
pytest-timeout's thread method cannot end; the run must still end, soon, naming the hung test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HUNG = textwrap.dedent(
    """
    import ctypes

    def test_holds_the_gil():
        ctypes.PyDLL(None).sleep(120)  # libc's sleep, called with the GIL held
    """
)


@pytest.mark.timeout(200)
def test_a_test_hung_with_the_gil_held_ends_the_run_with_its_stack(tmp_path: Path) -> None:
    (tmp_path / "test_hung.py").write_text(HUNG)
    options = ["-o", "timeout=1", "-o", "timeout_method=thread", "-o", "hard_timeout_extra=2"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", *options, "-q"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=100,  # the hung test sleeps 120 s: without the watchdog this expires
    )
    assert run.returncode != 0
    assert "Timeout (0:00:03)!" in run.stderr, run.stderr
    assert "in test_holds_the_gil" in run.stderr, run.stderr
