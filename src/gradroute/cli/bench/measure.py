"""Each strategy's gradient error against independent forwards, then its step time, strategies interleaved.

Error: the relative L2 error of each group's gradient against a reference of independent forwards (one fresh
forward per loss and ``torch.autograd.grad``, under the same dtype/autocast as the run, fp32 gradients).
Time: median and min of forward + backward after warm-up, the strategies interleaved step by step, so that
load from other processes hits all of them alike. A strategy that crashes is a result, not a failure.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..progress import Progress
from .runner import Runner


def crash_text(e: BaseException) -> str:
    """One line naming the exception, for the report."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"[:200]


def measure(
    r: Runner,
    strategies: list[str],
    *,
    steps: int,
    warmup: int,
    progress: Any = None,
) -> dict[str, dict[str, Any]]:
    """Errors against the reference, then interleaved timing. Returns ``strategy -> result`` (no memory)."""
    progress = progress or Progress(0, "", enabled=False)
    results = _errors(r, strategies, progress)
    ok = [s for s in strategies if "error" not in results[s]]
    for s in ok:  # the router's measured plan choice runs before timing (untimed), and is recorded
        chosen = r.settle(s)
        if chosen:
            results[s]["autotune"] = chosen
    times = _times(r, ok, steps, warmup, progress)
    for s in ok:
        results[s]["ms"] = statistics.median(times[s]) if times[s] else None
        results[s]["ms_min"] = min(times[s]) if times[s] else None
    return results


def _errors(r: Runner, strategies: list[str], progress: Any) -> dict[str, dict[str, Any]]:
    """One step per strategy against the reference: ``{"err", "err_groups"}``, or ``{"err": None, "error"}``."""
    ref = r.reference()
    results: dict[str, dict[str, Any]] = {}
    for s in strategies:
        r.prepare(s)
        r.zero()
        try:
            r.step(s)
            errs = r.errors(ref)
            results[s] = {"err": max(errs.values()), "err_groups": errs}
        except Exception as e:  # a strategy that crashes is a result, not a failure of the bench
            results[s] = {"err": None, "error": crash_text(e)}
        progress.update(1, f"check {s}")
    del ref
    r.zero()
    return results


def _times(r: Runner, strategies: list[str], steps: int, warmup: int, progress: Any) -> dict[str, list[float]]:
    """Milliseconds per timed step, per strategy; the strategies take turns step by step."""
    times: dict[str, list[float]] = {s: [] for s in strategies}
    for k in range(warmup + steps):
        for s in strategies:
            r.prepare(s)
            r.zero()
            r.sync()
            t0 = time.perf_counter()
            r.step(s)
            r.sync()
            if k >= warmup:
                times[s].append((time.perf_counter() - t0) * 1000)
            progress.update(1, f"{'warm-up' if k < warmup else 'time'} {s}")
    r.zero()
    return times
