"""How many autograd nodes the engine's dependency pass visits per routed backward, summed over its calls.

    python benchmarks/engine_reach.py            # SD-1.5 on ``meta``, batch 8, cut points, three plans

Each engine call first counts the dependencies of every node reachable from where it starts (torch prunes only
below the lowest topological level among its inputs, and a call that computes parameter gradients has leaves
among them), so on a large graph a plan of many calls pays a host cost per call that grows with the graph.
Prints, per plan, the engine calls, the graph's nodes, and the nodes reachable from each call's start nodes
summed over the calls. Counts only: no timing, no kernels.
"""

from __future__ import annotations

import torch
from trace_memory import fused_attention

import gradroute
from gradroute._planner import Program
from gradroute.cli import workloads


def reachable_per_call(program: Program) -> int:
    """Nodes reachable from each call's start nodes (its losses and gradient edges in), summed over the calls."""
    g = program.graph
    starts_of_loss = [[g.index[t.grad_fn] for t in r.losses] for r in program.routes]
    total = 0
    for call in program.plan.calls:
        w = call.wiring
        seen = {starts_of_loss[r][k] for r, k in w.losses} | {j for j, _ in w.edges_in}
        todo = list(seen)
        while todo:
            for j, _ in g.succ[todo.pop()]:
                if j not in seen:
                    seen.add(j)
                    todo.append(j)
        total += len(seen)
    return total


def main() -> None:
    torch.set_num_threads(1)
    wl = workloads.build("sd15", batch_size=8, device="meta", checkpointing=True)
    wl.set_checkpoint("cuts")
    plans = (gradroute.PlanOptions(), gradroute.PlanOptions(chunk=80), gradroute.PlanOptions(held_factor=0.0))
    for options in plans:
        with fused_attention(True):
            router = gradroute.Router(**wl.groups, autotune=False, plan_options=options)
            routes = router._run.routes(wl.forward()[1], {}, "plan")
            program, _ = router._run._program(routes, merge_shared=True)
        n, total = len(program.graph.nodes), reachable_per_call(program)
        print(
            f"{options}: {len(program.plan.calls)} engine calls, {n} nodes, reachable summed over the calls {total} "
            f"({total / n:.1f}x the graph)"
        )


if __name__ == "__main__":
    main()
