"""Run a benchmark script again in fresh processes: one process's ratios carry a bias of their own."""

from __future__ import annotations

import statistics
import subprocess
import sys


def outputs(n: int, script: str) -> tuple[list[str], list[str]]:
    """Run ``script`` ``n`` times, one after another, with this process's arguments less ``--processes N``.

    Returns:
        ``(stdouts, argv)``: each run's standard output, and the arguments passed on.
    """
    argv = sys.argv[1:]
    if "--processes" in argv:  # "--processes N": its value goes too
        k = argv.index("--processes")
        argv = argv[:k] + argv[k + 2 :]
    argv = [a for a in argv if not a.startswith("--processes=")]
    runs = [
        subprocess.run([sys.executable, script, *argv], check=True, capture_output=True, text=True).stdout
        for _ in range(n)
    ]
    return runs, argv


def ratio_summary(n: int, script: str) -> str:
    """Run ``script`` ``n`` times (:func:`outputs`) and summarise the ``ratio X`` each run prints: the median and
    the range, as ``"median M (range LO-HI)"``."""
    runs, _ = outputs(n, script)
    ratios = [float(out.split("ratio ")[1].split()[0]) for out in runs]
    return f"median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})"
