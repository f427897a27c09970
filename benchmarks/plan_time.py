"""The planner's own time per call: ``Router.plan`` on a cache miss (analysis) and on a cache hit (walk only).

One forward per workload, then ``repeats`` rounds of (miss, hit), interleaved; prints medians in milliseconds.
The collector is off while a call runs, as in ``Router`` (a collection would be charged to whichever call
happened to trigger it).

    PYTHONPATH=src python benchmarks/plan_time.py [--repeats 15] [--sd15] [--baseline OLD/src]

``--baseline`` also times the planner of another checkout's ``src`` (e.g. ``git archive main src | tar -x -C
OLD``) on the same graph, interleaved with this one, which is fair on a loaded machine; it expects the
planner of that time (``gradroute._planner.build``, since the restructuring of 2026-12-01) and checks that both
make the same calls.

``--sd15`` adds the full SD-1.5 architecture (random weights, 8x8 latents, batch 1, ``gradroute.checkpoint``
and ``cut_points``): about 4 GB of memory and a minute to build on a CPU. Needs diffusers and transformers.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import pathlib
import shutil
import statistics
import sys
import time
from typing import Any

import torch

import gradroute
from gradroute._planner import build
from gradroute.cli import workloads


def _time_plan(name: str, kind: str, repeats: int, baseline: Any, **build_kwargs: object) -> None:
    torch.manual_seed(0)
    wl = workloads.build(name, checkpointing=True, **build_kwargs)  # type: ignore[arg-type]
    assert wl.set_checkpoint is not None
    wl.set_checkpoint(kind)
    router = gradroute.Router(**wl.groups)
    _, losses = wl.forward()
    if baseline is not None:
        _against_baseline(f"{name}/{kind}", router, losses, repeats, baseline)
        return
    plan = router.plan(**losses)
    miss, hit = [], []
    for _ in range(repeats):
        router._run._cache.clear()
        gc.collect()
        t0 = time.perf_counter()
        router.plan(**losses)
        t1 = time.perf_counter()
        router.plan(**losses)
        t2 = time.perf_counter()
        miss.append(t1 - t0)
        hit.append(t2 - t1)
    print(
        f"{name}/{kind}: {plan.graph_nodes} nodes, {len(plan.calls)} calls: "
        f"miss {1e3 * statistics.median(miss):.1f} ms, hit {1e3 * statistics.median(hit):.1f} ms"
    )


def _load_baseline(src: str) -> Any:
    """The package under ``src/gradroute`` imported as ``gradroute_base``, reading this run's checkpoints."""
    import tempfile

    root = tempfile.mkdtemp()
    shutil.copytree(pathlib.Path(src) / "gradroute", pathlib.Path(root) / "gradroute_base")
    sys.path.insert(0, root)
    base = importlib.import_module("gradroute_base")
    ckpt = importlib.import_module("gradroute_base._checkpoint")
    from gradroute import _checkpoint

    # the segments were recorded by this checkout's gradroute.checkpoint: the baseline reads them from here
    ckpt.segments = _checkpoint.segments
    ckpt.held_bytes = _checkpoint.held_bytes
    return importlib.import_module("gradroute_base._planner") if base else None


def _against_baseline(label: str, router: Any, losses: dict, repeats: int, base_plan: Any) -> None:
    from gradroute._routing import CHECKPOINTS as _CHECKPOINTS

    routes = router._run.routes(losses, {}, "plan")
    options = router.plan_options
    new_cache, old_cache = type(router._run._cache)(), base_plan.PlanCache()
    old_checkpoints = base_plan.Checkpoints(segments=_CHECKPOINTS.segments, node_bytes=_CHECKPOINTS.node_bytes)
    times: dict[str, list[float]] = {"new miss": [], "new hit": [], "old miss": [], "old hit": []}

    def new() -> Any:
        return build(routes, options=options, cache=new_cache, checkpoints=_CHECKPOINTS)

    def old() -> Any:
        return base_plan.build(routes, options=options, cache=old_cache, checkpoints=old_checkpoints)

    a, b = new().plan, old().plan
    same = [(c.groups, c.retain, c.nodes, c.params, c.edges_in) for c in a.calls] == [
        (c.groups, c.retain, c.nodes, c.params, c.edges_in) for c in b.calls
    ] and (a.notes, a.kept_nodes, a.passes) == (b.notes, b.kept_nodes, b.passes)
    for _ in range(repeats):
        for tag, fn, cache in (("new", new, new_cache), ("old", old, old_cache)):
            cache.clear()
            gc.collect()
            gc.disable()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            fn()
            t2 = time.perf_counter()
            gc.enable()
            times[f"{tag} miss"].append(t1 - t0)
            times[f"{tag} hit"].append(t2 - t1)
    medians = ", ".join(f"{k} {1e3 * statistics.median(v):.1f} ms" for k, v in times.items())
    print(f"{label}: {len(a.calls)} calls, same plan: {same}; {medians}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sd15", action="store_true")
    parser.add_argument("--baseline", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    baseline = _load_baseline(args.baseline) if args.baseline else None
    _time_plan("sd-tiny", "gradroute", args.repeats, baseline, batch_size=2)
    if args.sd15:
        for kind in ("gradroute", "cuts"):
            _time_plan("sd15", kind, args.repeats, baseline, batch_size=1, latent_size=8)


if __name__ == "__main__":
    main()
