"""The planner's own time per call: ``Router.plan`` on a cache miss (analysis) and on a cache hit (walk only).

One forward per workload, then ``repeats`` rounds of (miss, hit), interleaved; prints medians in milliseconds.

    PYTHONPATH=src python benchmarks/plan_time.py [--repeats 15] [--sd15]

``--sd15`` adds the full SD-1.5 architecture (random weights, 8x8 latents, batch 1, ``gradroute.checkpoint``
and ``cut_points``): about 4 GB of memory and a minute to build on a CPU. Needs diffusers and transformers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gradroute

try:  # the CLI's workloads, wherever the package keeps them
    from gradroute.cli import _workloads as workloads  # type: ignore[import-not-found,unused-ignore]
except ImportError:
    from gradroute import _workloads as workloads  # type: ignore[no-redef,attr-defined,unused-ignore]


def _time_plan(name: str, kind: str, repeats: int, **build_kwargs: object) -> None:
    torch.manual_seed(0)
    wl = workloads.build(name, checkpointing=True, **build_kwargs)  # type: ignore[arg-type]
    assert wl.set_checkpoint is not None
    wl.set_checkpoint(kind)
    router = gradroute.Router(**wl.groups)
    _, losses = wl.forward()
    plan = router.plan(**losses)
    miss, hit = [], []
    for _ in range(repeats):
        router._cache.clear()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sd15", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _time_plan("sd-tiny", "gradroute", args.repeats, batch_size=2)
    if args.sd15:
        for kind in ("gradroute", "cuts"):
            _time_plan("sd15", kind, args.repeats, batch_size=1, latent_size=8)


if __name__ == "__main__":
    main()
