"""``gradroute bench --step``: the whole training iteration, the router's loop against the hand-written one.

The loops (``gradroute.cli.bench.loops``) each train their own copy of the workload. What is measured:

* **Time**: forward + routed backward + optimizer step (unscale, clipping, both optimizers, the scaler's
  update, schedulers) + ``zero_grad``, per iteration, the loops taking turns iteration by iteration (round
  robin, ``gradroute.cli.bench.measure.round_robin``, so that load from other processes hits both alike) after
  warm-up; medians and interquartile ranges of ``torch.utils.benchmark.Measurement``, clocked with
  ``torch.utils.benchmark.timer`` (it synchronises CUDA).
  Before timing, the router's measured plan choice runs untimed, and the hand-written loop runs as many
  iterations, so that both loops have trained the same number of iterations on the same batch.
* **Parameters**: their relative L2 difference between the two loops after every iteration above: both loops
  train the same thing, so it is at rounding level (0 where both make the same kernels' calls).
* **Peak memory of the whole iteration**, in a child process per loop (``--_one LOOP``), after warm-up
  iterations (the optimizers' state exists) and the measured plan choice: the most memory in use at any point
  of an iteration, counted from before the workload was built (after a throwaway copy of the loop ran two
  iterations, so that code pages and lazy initialisations count in neither loop), so it includes the weights,
  the optimizers' state, the gradients, and the previous iteration's boundary and losses, still referenced
  during the next forward. CUDA: ``max_memory_allocated``; CPU: the resident set's high-water mark
  (``VmHWM``, reset through ``/proc/self/clear_refs``; one thread; allocations of 64 KiB or more mapped on their
  own, so that the resident set follows the live tensors; it also counts Python objects, such as the router's
  plans, which matter only with tiny tensors). ``rest`` is the memory in use between two iterations.

No bound is built in: ``--targets time=1.03,peak=1.01`` prints each ratio to the hand-written loop against the
bound given.
"""

from __future__ import annotations

import argparse
import gc
import json
from functools import partial
from typing import Any

import torch
from torch.utils.benchmark import timer

from ..choices import DEFAULT_BATCH
from ..common import progress_bar, rel_error, resolve_device
from .loops import LOOPS, SETUP, Loop, make_loop
from .measure import round_robin
from .memory import child_argv, proc_status, reset_hwm, run_children
from .report import run_fields
from .runner import bench_dtype, workload_from_args
from .step_report import parse_targets, step_table, step_targets


def run(args: argparse.Namespace) -> int:
    """``gradroute bench --step``; see ``gradroute bench --help``."""
    if args._one:
        return child(args)
    _check_args(args)
    bounds = parse_targets(args.targets)
    dev = resolve_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = bench_dtype(args.dtype, dev)
    loops = {name: loop_from_args(args, name, dev, dtype) for name in LOOPS}
    total = len(LOOPS) * (args.warmup + args.steps + (0 if args.no_memory else 1))
    progress = progress_bar(total, f"bench --step {args.workload}")
    settled = loops["gradroute"].settle()
    for _ in range(settled):
        loops["hand_cut"].iterate()
    times = round_robin(
        partial(_iteration_seconds, loops),
        list(loops),
        steps=args.steps,
        warmup=args.warmup,
        progress=progress,
        label="bench --step",
    )
    ref = loops[LOOPS[0]]
    results: dict[str, dict[str, Any]] = {
        name: {"ms": times[name].median * 1000, "iqr_ms": times[name].iqr * 1000, "param_diff": _param_diff(loop, ref)}
        for name, loop in loops.items()
    }
    first = loops["gradroute"]
    results["gradroute"]["autotune"] = first.chosen()
    setup = {**SETUP, "optimizer": f"AdamW ({first.optimizer_kind})", "scaler": first.scaler is not None}
    n_batch = args.batch_size if args.batch_size is not None else DEFAULT_BATCH[args.workload]
    del loops, ref, first
    gc.collect()
    method = _peaks(args, dev, dtype, results, progress)
    progress.close()
    report = {
        "mode": "step",
        **run_fields(args, dev, n_batch, dtype, method),
        "settle": settled,
        "setup": setup,
        "results": results,
    }
    report["targets"] = step_targets(results, bounds)
    print(step_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _check_args(args: argparse.Namespace) -> None:
    """What ``--step`` refuses, and the checks of ``--steps`` and ``--warmup``."""
    for flag, value in (("--compile", args.compile), ("--strategies", args.strategies), ("--plot", args.plot)):
        if value is not None:
            raise ValueError(f"`{flag}` does not apply to `--step` (it compares two whole loops), got {value!r}")
    if args.steps < 1:
        raise ValueError(f"`--steps` must be >= 1, got {args.steps}")
    if args.warmup < 0:
        raise ValueError(f"`--warmup` must be >= 0, got {args.warmup}")


def loop_from_args(args: argparse.Namespace, name: str, dev: torch.device, dtype: str) -> Loop:
    """The loop ``name`` on a fresh copy of the workload the arguments name (a GradScaler with fp16)."""
    wl = workload_from_args(args, dev)
    if wl.set_checkpoint is not None:
        wl.set_checkpoint("torch")  # both loops with torch.utils.checkpoint
    return make_loop(name, wl, dtype, scaler=dtype == "fp16", static_graph=args.static_graph)


def _iteration_seconds(loops: dict[str, Loop], name: str) -> float:
    """One training iteration of the loop ``name``, in seconds."""
    loop = loops[name]
    t0 = timer()
    loop.iterate()
    return timer() - t0


def _param_diff(loop: Loop, ref: Loop) -> float:
    """The relative L2 difference of ``loop``'s parameters from ``ref``'s (float64)."""
    return rel_error([p for ps in loop.params for p in ps], [p for ps in ref.params for p in ps])


def _peaks(args: argparse.Namespace, dev: torch.device, dtype: str, results: dict[str, Any], progress: Any) -> str:
    """Adds ``peak_mib`` and ``rest_mib`` (or ``memory_error``) to each loop's results; returns the method."""
    if args.no_memory:
        for v in results.values():
            v.update(peak_mib=None, rest_mib=None)
        return "not measured (--no-memory)"
    argvs = {name: [*child_argv(args, dtype, name, str(dev)), "--step"] for name in LOOPS}
    peaks = run_children(argvs, progress)
    for name, v in results.items():
        v["peak_mib"], v["rest_mib"] = peaks[name].get("peak_mib"), peaks[name].get("rest_mib")
        if peaks[name].get("autotune"):
            v["memory_autotune"] = peaks[name]["autotune"]  # the child's own measured plan choice
        if "error" in peaks[name]:
            v["memory_error"] = peaks[name]["error"]
    how = sorted({str(p["method"]) for p in peaks.values() if "method" in p})
    return f"peak of a whole iteration in a child process per loop, from before the workload ({', '.join(how)})"


def child(args: argparse.Namespace) -> int:
    """A memory child (``--step --_one LOOP``): the loop's peak and rest; prints one JSON line."""
    dev = resolve_device(args.device)
    torch.set_num_threads(1)
    cuda = dev.type == "cuda"
    if not cuda and not reset_hwm():
        raise RuntimeError("the CPU peak needs /proc/self/clear_refs (Linux)")
    dtype = bench_dtype(args.dtype, dev)
    # a throwaway copy first: the code pages and lazy initialisations of the first iterations then count in
    # the baseline, not in the loop's memory
    spare = loop_from_args(args, args._one, dev, dtype)
    for _ in range(2):
        spare.iterate()
    del spare
    gc.collect()
    base = torch.cuda.memory_allocated(dev) if cuda else proc_status("VmRSS")
    loop = loop_from_args(args, args._one, dev, dtype)
    for _ in range(2):  # warm-up: the optimizers' state, lazy initialisation, allocator pools
        loop.iterate()
    loop.settle()
    loop.iterate()  # the iteration that ends the measured plan choice still holds some of its tensors after it
    peak = rest = 0
    for _ in range(2):
        gc.collect()
        if cuda:
            torch.cuda.synchronize(dev)
            rest = torch.cuda.memory_allocated(dev) - base
            torch.cuda.reset_peak_memory_stats(dev)
        else:
            rest = proc_status("VmRSS") - base
            reset_hwm()
        loop.iterate()
        if cuda:
            torch.cuda.synchronize(dev)
        peak = max(peak, (torch.cuda.max_memory_allocated(dev) if cuda else proc_status("VmHWM")) - base)
    method = "cuda max_memory_allocated" if cuda else "VmHWM, 1 thread"
    out = {"peak_mib": peak / 2**20, "rest_mib": rest / 2**20, "method": method, "autotune": loop.chosen()}
    print(json.dumps(out))
    return 0
