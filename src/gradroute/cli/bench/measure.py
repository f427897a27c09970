"""Each strategy's gradient error against independent forwards, then its step time, strategies interleaved.

Error: the relative L2 error of each group's gradient against a reference of independent forwards (one fresh
forward per loss and ``torch.autograd.grad``, under the same dtype/autocast as the run, fp32 gradients).
Time: forward + backward after warm-up, the strategies interleaved step by step (:func:`round_robin`), so
that load from other processes hits all of them alike; the statistics (median, interquartile range) are
those of ``torch.utils.benchmark.Measurement``. A strategy that crashes is a result, not a failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.benchmark import Measurement, TaskSpec

from ..common import progress_bar
from .runner import Runner


def crash_text(e: BaseException) -> str:
    """One line naming the exception, for the report."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"[:200]


def round_robin(
    run: Callable[[str], float], names: Sequence[str], *, steps: int, warmup: int, progress: Any, label: str
) -> dict[str, Measurement]:
    """Per name, the ``Measurement`` of its ``steps`` timed runs after ``warmup`` untimed ones.

    The names take turns run by run (``a, b, c, a, b, c, ...``), so that load from other processes hits all of
    them alike; ``torch.utils.benchmark.Timer`` would run one statement's runs back to back instead.

    Args:
        run: runs one step of a name; returns the seconds it took.
        names: what to run, in the order of each turn.
        steps: timed runs per name.
        warmup: untimed runs per name first.
        progress: a ``tqdm`` bar (:func:`gradroute.cli.common.progress_bar`), advanced once per run.
        label: the measurements' label (``TaskSpec.label``); each one's statement is its name.
    """
    raw: dict[str, list[float]] = {name: [] for name in names}
    for k in range(warmup + steps):
        for name in names:
            seconds = run(name)
            if k >= warmup:
                raw[name].append(seconds)
            progress.set_postfix_str(f"{'warm-up' if k < warmup else 'time'} {name}", refresh=False)
            progress.update()
    return {name: Measurement(1, times, TaskSpec(stmt=name, setup="", label=label)) for name, times in raw.items()}


def measure(
    r: Runner,
    strategies: list[str],
    *,
    steps: int,
    warmup: int,
    progress: Any = None,
) -> dict[str, dict[str, Any]]:
    """Errors against the reference, then interleaved timing. Returns ``strategy -> result`` (no memory):
    ``err``, ``err_groups``, and ``ms`` (median), ``ms_min``, ``iqr_ms`` of the timed steps (None without any);
    or ``{"err": None, "error"}`` for a strategy that crashed."""
    progress = progress or progress_bar(0, "", enabled=False)
    results = _errors(r, strategies, progress)
    ok = [s for s in strategies if "error" not in results[s]]
    for s in ok:  # the router's measured plan choice runs before timing (untimed), and is recorded
        chosen = r.settle(s)
        if chosen:
            results[s]["autotune"] = chosen
    times = round_robin(lambda s: _step_seconds(r, s), ok, steps=steps, warmup=warmup, progress=progress, label="bench")
    r.zero()
    for s in ok:
        m = times[s]
        results[s].update(
            ms=m.median * 1000 if m.times else None,
            ms_min=min(m.times) * 1000 if m.times else None,
            iqr_ms=m.iqr * 1000 if m.times else None,
        )
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
        progress.set_postfix_str(f"check {s}", refresh=False)
        progress.update()
    del ref
    r.zero()
    return results


def _step_seconds(r: Runner, strategy: str) -> float:
    """One timed step of ``strategy`` (forward + backward, device synchronised), in seconds."""
    r.prepare(strategy)
    r.zero()
    r.sync()
    t0 = time.perf_counter()
    r.step(strategy)
    r.sync()
    return time.perf_counter() - t0
