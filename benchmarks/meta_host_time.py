"""Host time of a routed backward against the summed backward on the ``meta`` device (no kernels: shapes only).

    python benchmarks/meta_host_time.py                         # SD-1.5, batch 8, 512 px, cut points
    python benchmarks/meta_host_time.py --kind gradroute --batch-size 32
    python benchmarks/meta_host_time.py --static-graph                          # Router(static_graph=True)

Builds the bench's ``sd15`` workload on ``meta`` with checkpointing (``--kind``: ``cuts``, ``gradroute``,
``blocks`` or ``torch``, as ``benchmarks/trace_memory.py``), then for ``Router(autotune=False)`` and for the
default ``Router()`` (after its measured plan choice is done) times 5 routed backwards, each interleaved with a
backward of the summed losses: CPU time of the calling thread (robust to other processes' load), medians. On
``meta`` each op runs torch's Python meta function, far slower than a CUDA launch: the ratio says how much
more op work the routed backward does (recomputations, the upstream loss's input-gradient chain through the
downstream network), plus the router's own host work; it is not a GPU-time estimate.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from trace_memory import fused_attention

import gradroute
from gradroute.cli import workloads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", default="cuts", choices=("cuts", "gradroute", "blocks", "torch"))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--static-graph", action="store_true", help="Router(static_graph=True): no walk after two")
    args = p.parse_args()
    torch.set_num_threads(1)
    wl = workloads.build("sd15", batch_size=args.batch_size, device="meta", checkpointing=True)
    wl.set_checkpoint(args.kind)
    clock = time.thread_time
    with fused_attention(True):
        for autotune in (False, True):
            router = gradroute.Router(**wl.groups, autotune=autotune, static_graph=args.static_graph)
            tuning = 0
            while True:
                router.backward(**wl.forward()[1])
                tuning += 1
                if not router.autotuning:
                    break
            routed, summed = [], []
            for _ in range(args.steps):
                losses = wl.forward()[1]
                t = clock()
                (losses[wl.up_name] + losses[wl.down_name]).backward()
                summed.append(clock() - t)
                losses = wl.forward()[1]
                t = clock()
                router.backward(**losses)
                routed.append(clock() - t)
                for m in wl.groups.values():
                    m.zero_grad(set_to_none=True)
            plan = router.plan(**wl.forward()[1])
            r, s = statistics.median(routed), statistics.median(summed)
            print(
                f"{args.kind}, autotune {autotune}, static_graph {args.static_graph} ({tuning} backwards until "
                f"chosen): {len(plan.calls)} engine calls, "
                f"{plan.graph_nodes} nodes; routed {r * 1e3:.0f} ms, summed {s * 1e3:.0f} ms CPU: {r / s:.2f}x"
            )
            if autotune:
                print(next((n for n in plan.notes if n.startswith("autotune")), "autotune: nothing to measure"))


if __name__ == "__main__":
    main()
