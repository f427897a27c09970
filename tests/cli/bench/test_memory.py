"""The CPU memory measurement's child process (`python -m gradroute bench --_one STRATEGY`)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_runs_as_a_module():
    # the CPU memory measurement re-runs `python -m gradroute bench --_one ...`: the entry point must work
    proc = subprocess.run(
        [sys.executable, "-m", "gradroute", "bench", "--workload", "gan", "--width", "8", "--batch-size", "2",
         "--_one", "gradroute"],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"] >= 0
