"""Where the host time of a routed backward goes, in the host-bound regime (tiny tensors, one thread).

Usage (from the repository root)::

    python benchmarks/profile_host.py [--checkpointing] [--kind gradroute|cuts|blocks|torch] [--no-autotune]
        [--static-graph]

Runs the bench's ``sd-tiny`` workload at width 8, batch 1, one CPU thread (``gradroute bench --workload sd-tiny
--width 8 --batch-size 1 --threads 1``) and prints, per routed backward (forward not included):

* medians of the calling thread's CPU time (with one torch thread the engine runs there; robust to other
  processes' load, unlike wall-clock time) without a profiler, the routed backward, the hand-written ``cut``
  and the summed backward interleaved step by step: the router's plan lookup (graph walk, signature, plan
  cache), its execution, and the cycle collector's pauses (mean: they come every few steps); and the median
  of each step's routed / ``cut`` ratio (the two ran next to each other, under the same load);
* a cProfile of the routed backwards alone: engine calls, Python calls, and the profiled time by part;
* torch.profiler's count of aten ops per backward (recomputations show up here).

The proportions and counts are stable on a loaded machine; the milliseconds are not (use the bench for those).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import inspect
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import gradroute
from gradroute import _routing

# (part, predicate on (file, function name)) for cProfile's own time; the first match wins
PARTS: list[tuple[str, Callable[[str, str], bool]]] = [
    ("engine (C++: autograd nodes and kernels)", lambda f, n: n.startswith("<method 'run_backward'")),
    ("graph walk + signature", lambda f, n: f.endswith("_graph.py") and n in ("walk", "_topological")),
    ("plan cache lookup / planning", lambda f, n: "_plan" in f or "_planner" in f),
    ("autotune bookkeeping", lambda f, n: "_autotune" in f),
    ("Routing._program own time", lambda f, n: n == "_program"),
    (
        "router: loss checks, step bookkeeping",
        lambda f, n: f.endswith(("_router.py", "_routing.py", "_loss_checks.py", "_refusals.py", "_step.py")),
    ),
    ("handoff hooks (cut gradients, .grad steal)", lambda f, n: "_execute" in f and n in ("give", "close", "hook")),
    ("executor: Python around each engine call", lambda f, n: "_execute" in f or "_session" in f),
    ("torch.autograd Python wrappers", lambda f, n: "torch/autograd" in f or "run_backward" in n),
    ("checkpoint: per-consumer views", lambda f, n: "_checkpoint" in f and n == "__torch_function__"),
    ("checkpoint: recipes' dispatch mode", lambda f, n: "_checkpoint" in f and n == "__torch_dispatch__"),
    ("checkpoint: pack/unpack/recompute bookkeeping", lambda f, n: "_checkpoint" in f),
    ("recomputed forward (modules, model code, ops)", lambda f, n: "nn/" in f or "_demo" in f),
    ("other torch Python (shape checks, hook handles, pytree)", lambda f, n: True),
]


def _clock() -> float:
    # CPU time of this thread: with one torch thread the CPU engine runs in the caller's thread, and on a loaded
    # machine this counts what the backward costs, not how long it waited for a core
    return time.thread_time()


def _workload(args: argparse.Namespace) -> Any:
    from gradroute.cli.bench.runner import Runner
    from gradroute.cli.workloads import build

    torch.set_num_threads(1)
    wl = build("sd-tiny", batch_size=1, device=torch.device("cpu"), checkpointing=args.checkpointing, width=8)
    r = Runner(wl, "fp32")
    # (a tree from before ``Router(autotune=)`` has no measured choice: ``--no-autotune`` compares to it)
    takes_autotune = "autotune" in inspect.signature(gradroute.Router).parameters
    kwargs: dict[str, Any] = {"autotune": args.autotune} if takes_autotune else {}
    if args.static_graph:  # ``Router(static_graph=True)``: the graph walked on every 100th backward only
        kwargs["static_graph"] = True
    r.router = gradroute.Router(dict(wl.groups), **kwargs)
    if args.checkpointing:
        wl.set_checkpoint(args.kind)
    return r


def _routed(r: Any) -> Callable[[], None]:
    _, lu, ld = r.forward()
    return lambda: r.router.backward(**{r.wl.up_name: lu, r.wl.down_name: ld})


def _cut(r: Any) -> Callable[[], None]:
    h, lu, ld = r.forward()

    def run() -> None:
        (g,) = torch.autograd.grad(lu, h, retain_graph=True)
        ld.backward(inputs=r.down_params)
        h.backward(g, inputs=r.up_params)

    return run


def _sum(r: Any) -> Callable[[], None]:
    _, lu, ld = r.forward()
    return lambda: (lu + ld).backward()


def wall(r: Any, steps: int) -> dict[str, float]:
    """Medians (ms) of the backwards, interleaved, and the router's parts."""
    parts: dict[str, list[float]] = {"program": [], "execute": []}
    real_program, real_execute = r.router._run._program, _routing.execute

    def timed(fn: Callable, into: list[float]) -> Callable:
        def run(*a: Any, **k: Any) -> Any:
            t = _clock()
            try:
                return fn(*a, **k)
            finally:
                into.append(_clock() - t)

        return run

    pause = [0.0, 0.0]

    def collector(phase: str, info: dict) -> None:
        if phase == "start":
            pause[1] = _clock()
        else:
            pause[0] += _clock() - pause[1]

    r.router._run._program = timed(real_program, parts["program"])
    _routing.execute = timed(real_execute, parts["execute"])
    gc.callbacks.append(collector)
    times: dict[str, list[float]] = {"routed": [], "cut": [], "sum": []}
    gc_routed: list[float] = []
    try:
        for _ in range(steps):
            for name, make in (("routed", _routed), ("cut", _cut), ("sum", _sum)):
                r.zero()
                run = make(r)
                before = pause[0]
                t = _clock()
                run()
                times[name].append(_clock() - t)
                if name == "routed":
                    gc_routed.append(pause[0] - before)
    finally:
        r.router._run._program = real_program
        _routing.execute = real_execute
        gc.callbacks.remove(collector)
    out = {f"{k} backward": statistics.median(v) * 1e3 for k, v in times.items()}
    # each step's routed and cut backwards ran next to each other (the same load): their ratio, step by step
    out["routed / cut, median of the steps' ratios"] = statistics.median(
        a / b for a, b in zip(times["routed"], times["cut"])
    )
    out.update({f"router: {k}": statistics.median(v[-steps:]) * 1e3 for k, v in parts.items()})
    out["router: cycle collector (mean)"] = statistics.mean(gc_routed) * 1e3
    return out


def profile(r: Any, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """cProfile of ``steps`` routed backwards: own time by part (fractions), and counts per backward."""
    prof = cProfile.Profile()
    for _ in range(steps):
        r.zero()
        run = _routed(r)
        prof.enable()
        run()
        prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values())
    by_part = dict.fromkeys((p for p, _ in PARTS), 0.0)
    counts = {"engine calls": 0.0, "Python function calls": 0.0, "node pre-hooks registered": 0.0}

    def part_of(key: tuple, depth: int = 0) -> str:
        file, _, name = key
        callers = stats[key][4]
        if file == "~" and not name.startswith("<method 'run_backward'") and callers and depth < 5:
            # a builtin (len, list.append, a tensor method...): the part of the caller that spent most in it
            return part_of(max(callers, key=lambda c: callers[c][2]), depth + 1)
        return next(p for p, pred in PARTS if pred(file, name))

    for key, (_, ncalls, tottime, _, _) in stats.items():
        name = key[2]
        by_part[part_of(key)] += tottime / total
        counts["Python function calls"] += ncalls / steps
        if name.startswith("<method 'run_backward'"):
            counts["engine calls"] += ncalls / steps
        if "register_prehook" in name:
            counts["node pre-hooks registered"] += ncalls / steps
    return by_part, counts


def aten_ops(r: Any, steps: int) -> dict[str, float]:
    """aten ops per backward (torch.profiler), routed and cut."""
    out = {}
    for name, make in (("routed", _routed), ("cut", _cut)):
        runs = []
        for _ in range(steps):
            r.zero()
            runs.append(make(r))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
            for run in runs:
                run()
            del runs
        ops = sum(e.count for e in p.key_averages() if e.key.startswith("aten::"))
        out[f"aten ops per {name} backward"] = ops / steps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--kind", default="gradroute", choices=["gradroute", "cuts", "blocks", "torch"])
    ap.add_argument("--no-autotune", dest="autotune", action="store_false")
    ap.add_argument("--static-graph", action="store_true")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    r = _workload(args)
    while True:  # warm up, and let the measured choice finish
        r.zero()
        _routed(r)()
        if not getattr(r.router, "autotuning", False):
            break
    for _ in range(3):
        r.zero()
        _routed(r)()
    ckpt = args.checkpointing and args.kind
    print(
        f"sd-tiny width 8 batch 1, 1 thread, checkpointing {ckpt}, autotune {args.autotune}, "
        f"static_graph {args.static_graph}"
    )
    for k, v in wall(r, args.steps).items():
        print(f"  {k:45s} {v:8.3f}" + ("x" if "ratio" in k else " ms"))
    by_part, counts = profile(r, args.steps)
    for k, v in counts.items():
        print(f"  {k:45s} {v:8.1f} per backward")
    for k, v in aten_ops(r, 5).items():
        print(f"  {k:45s} {v:8.1f}")
    print("  cProfile, own time by part (share of the routed backward under the profiler):")
    for k, v in sorted(by_part.items(), key=lambda kv: -kv[1]):
        if v >= 0.0005:
            print(f"    {k:50s} {v:6.1%}")


if __name__ == "__main__":
    main()
