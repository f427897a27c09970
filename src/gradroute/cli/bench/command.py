"""``gradroute bench``: run every strategy on one workload and report error, time and peak memory.

What is measured and how: ``gradroute.cli.bench.measure`` (error, time) and ``gradroute.cli.bench.memory``
(peak memory); the strategies: ``gradroute.cli.bench.strategies``.
"""

from __future__ import annotations

import argparse
import gc
import json
from typing import Any

import torch

from ..choices import CKPT_STRATEGIES, DEFAULT_BATCH, STRATEGIES
from ..common import has_matplotlib, progress_bar, resolve_device
from .compiled import CompiledRunner, measure_both
from .measure import measure
from .memory import child, cpu_peaks, cuda_peak
from .plot import plot
from .report import parse_targets, run_fields, table, targets
from .runner import Runner, bench_dtype


def parse_strategies(spec: str | None, checkpointing: bool = False) -> list[str]:
    """The strategies named by ``--strategies`` (all by default; ``gradroute_ckpt`` & co. need checkpointing)."""
    known = list(STRATEGIES)
    if checkpointing:
        known += CKPT_STRATEGIES
    if spec is None:
        return known
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError(f"`--strategies` names no strategy, got {spec!r}")
    for s in names:
        if s in CKPT_STRATEGIES and s not in known:
            raise ValueError(f"`--strategies`: {s!r} needs `--checkpointing`")
        if s not in known:
            raise ValueError(f"`--strategies`: unknown strategy {s!r}; choose from {','.join(known)}")
    return list(dict.fromkeys(names))


def run(args: argparse.Namespace) -> int:
    """``gradroute bench``; see ``gradroute bench --help``."""
    if getattr(args, "step", False):
        from .step import run as run_step

        return run_step(args)
    if getattr(args, "_one", None):
        return child(args)
    bounds = parse_targets(getattr(args, "targets", None))
    strategies = parse_strategies(args.strategies, args.checkpointing)
    dev = resolve_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = bench_dtype(args.dtype, dev)
    _check_args(args)
    r = (CompiledRunner if args.compile else Runner).from_args(args, dev)
    name, groups = r.wl.name, [r.wl.up_name, r.wl.down_name]
    n_batch = args.batch_size if args.batch_size is not None else DEFAULT_BATCH[name]
    memory = 0 if args.no_memory else len(strategies)  # a step each (less those that crashed)
    total = len(strategies) * (1 + args.warmup + args.steps) * (2 if args.compile else 1) + memory
    progress = progress_bar(total, f"bench {name}")
    results, compiled = _measure(r, args, strategies, progress)
    ok = [s for s in strategies if "error" not in results[s]]
    if args.no_memory:
        method = "not measured (--no-memory)"
    elif dev.type == "cuda":
        method = _cuda_peaks(r, ok, results, progress)
    else:
        del r  # the children measure; the parent lets go of its models first
        gc.collect()
        method = _cpu_peaks(args, dtype, ok, results, progress)
    progress.close()
    for s in strategies:
        for key in ("ms", "ms_min", "peak_mib"):
            results[s].setdefault(key, None)
    report = {
        **run_fields(args, dev, n_batch, dtype, method),
        "groups": groups,
        "results": results,
        "compile": compiled,
    }
    report["targets"] = targets(results, bounds)
    _write(report, args)
    return 0


def _check_args(args: argparse.Namespace) -> None:
    """The checks of ``--steps``, ``--warmup`` and ``--plot`` that argparse does not make."""
    if args.steps < 1:
        raise ValueError(f"`--steps` must be >= 1, got {args.steps}")
    if args.warmup < 0:
        raise ValueError(f"`--warmup` must be >= 0, got {args.warmup}")
    if args.plot and not has_matplotlib():
        raise ValueError("`--plot` needs matplotlib (pip install 'gradroute[demo]')")


def _measure(r: Runner, args: argparse.Namespace, strategies: list[str], progress: Any) -> tuple[dict[str, Any], Any]:
    """Error and time of every strategy (eager, and compiled with ``--compile``): ``(results, compiled)``."""
    if isinstance(r, CompiledRunner):
        return measure_both(r, args.compile, strategies, steps=args.steps, warmup=args.warmup, progress=progress)
    return measure(r, strategies, steps=args.steps, warmup=args.warmup, progress=progress), None


def _write(report: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the table; write ``--json`` and ``--plot`` if asked."""
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(report, args.plot)


def _cuda_peaks(r: Runner, ok: list[str], results: dict[str, Any], progress: Any) -> str:
    """Adds ``peak_mib`` to the results of the strategies that ran; returns how it was measured."""
    for s in ok:
        results[s]["peak_mib"] = cuda_peak(r, s) / 2**20
        progress.set_postfix_str(f"memory {s}", refresh=False)
        progress.update()
    return "cuda max_memory_allocated"


def _cpu_peaks(args: argparse.Namespace, dtype: str, ok: list[str], results: dict[str, Any], progress: Any) -> str:
    """Adds ``peak_mib`` (or ``memory_error``) to the results of the strategies that ran, a child process
    each; returns how it was measured."""
    peaks = cpu_peaks(args, dtype, ok, progress)
    how = sorted({str(peaks[s]["method"]) for s in ok if "method" in peaks[s]})
    for s in ok:
        results[s]["peak_mib"] = peaks[s].get("peak_mib")
        if "error" in peaks[s]:
            results[s]["memory_error"] = peaks[s]["error"]
    return f"peak RSS in a child process per strategy, 1 thread ({', '.join(how)})"
