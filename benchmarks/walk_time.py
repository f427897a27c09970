"""The graph walk alone, as a routed backward meets it: a fresh graph after each forward, this tree against another.

Every routed backward without ``static_graph`` walks its losses' whole graph (NOTE [One walk: structure, signature
and the freed check] in ``_graph.py``), right after the forward made it: the nodes are new, their memory cold.
This times that walk on the bench's host-bound ``sd-tiny`` (width 8, batch 1, one thread; ``--checkpointing``:
``gradroute.checkpoint`` with cut points), a new forward before each walk, against the walk of another checkout
interleaved with it (the two take turns going first: the first walk after a forward of a step was a few percent
cheaper on our machine), and checks that both record the same graph. It also times the floor of any walk in Python:
a sweep that only collects the nodes ``next_functions`` hands out. Medians of the calling thread's CPU time, µs.

    PYTHONPATH=src python benchmarks/walk_time.py --baseline OLD/src [--checkpointing] [--repeats 300] [--sd15]
        [--no-probe] [--cpp]

``--cpp``: also time ``benchmarks/walk_cpp.py``'s C++ sweep, with and without the structure the signature records
(an experiment: it builds a C++ extension first, and checks that it records the same edges as this tree's walk).

``--no-probe``: both walks without the freed check, as a routed backward whose ``.grad`` writes the router can undo
runs it (NOTE [Undoing a failed routed backward] in ``_execute.py``; a baseline from before that has no switch and
probes).

``--sd15``: the full SD-1.5 architecture instead (random weights from configs, 8x8 latents, batch 1; needs
diffusers and transformers, about a minute to build).

(``git archive <commit> src | tar -x -C OLD`` makes ``OLD/src``.)
"""

from __future__ import annotations

import argparse
import functools
import gc
import inspect
import statistics
import time
from array import array
from collections.abc import Callable
from typing import Any

import torch
from plan_time import _load_baseline

from gradroute._graph import root_node, walk
from gradroute.cli.bench.runner import Runner
from gradroute.cli.workloads import build


def sweep(roots: list[Any], params: dict[int, int]) -> list[Any]:
    """The floor: every node reachable from ``roots``, nothing recorded about them."""
    index: dict[Any, int] = {}
    nodes: list[Any] = []
    for r in roots:
        if r not in index:
            index[r] = len(nodes)
            nodes.append(r)
    for node in nodes:
        for fn, _ in node.next_functions:
            if fn is not None and fn not in index:
                index[fn] = len(nodes)
                nodes.append(fn)
    return nodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--sd15", action="store_true", help="the SD-1.5 architecture (8x8 latents) instead")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--no-probe", dest="probe", action="store_false", help="walk without the freed check")
    parser.add_argument("--cpp", action="store_true", help="also time a C++ sweep (builds benchmarks/walk_cpp.py)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base_walk = _load_baseline(args.baseline).build.__globals__["walk"]
    this_walk = functools.partial(walk, probe=args.probe)
    if "probe" in inspect.signature(base_walk).parameters:
        base_walk = functools.partial(base_walk, probe=args.probe)
    workload = "sd15" if args.sd15 else "sd-tiny"
    size: dict[str, Any] = {"latent_size": 8} if args.sd15 else {"width": 8}
    wl = build(workload, batch_size=1, device=torch.device("cpu"), checkpointing=args.checkpointing, **size)
    runner = Runner(wl, "fp32")
    if args.checkpointing:
        wl.set_checkpoint("cuts")
    marks: dict[int, int] = {}
    for params in (runner.up_params, runner.down_params):
        for p in params:
            marks.setdefault(id(p), len(marks) + 1)
    walks: dict[str, Callable[[list[Any], dict[int, int]], Any]] = {
        "this": this_walk,
        "baseline": base_walk,
        "sweep": sweep,
    }
    if args.cpp:
        import walk_cpp

        ext = walk_cpp.load()
        walks["C++ sweep + structure"] = lambda roots, _: ext.sweep(roots)
        walks["C++ sweep"] = lambda roots, _: ext.bare(roots)
    times: dict[str, list[float]] = {k: [] for k in walks}
    signatures = {}
    gc.disable()  # as in a routed backward (NOTE [The cycle collector and the routed backward])
    try:
        names = list(walks)
        for step in range(args.repeats):
            turn = step % len(names)  # each goes first in turn: which runs first after the forwards matters
            for name in names[turn:] + names[:turn]:
                fn = walks[name]
                _, lu, ld = runner.forward()
                roots = [root_node(lu), root_node(ld)]
                t = time.thread_time()
                g = fn(roots, marks)
                times[name].append(time.thread_time() - t)
                if step == 0 and name in ("this", "baseline"):
                    signatures[name] = (g.signature, sorted(g.leaf), g.freed)
                elif step == 0 and name == "C++ sweep + structure":
                    signatures[name] = [array("q", b).tolist() for b in g[1:]]  # edges, ends, leaves
                del g, lu, ld, roots
    finally:
        gc.enable()
    nodes = len(sweep([root_node(t) for t in runner.forward()[1:]], marks))
    same = signatures["this"] == signatures["baseline"]
    if args.cpp:
        sig, leaves, _ = signatures["this"]
        same_cpp = signatures["C++ sweep + structure"] == [sig[2], sig[4], leaves]
        print(f"  the C++ sweep records the same edges and leaves: {same_cpp}")
    medians = ", ".join(f"{k} {1e6 * statistics.median(v):.0f}" for k, v in times.items())
    ratio = statistics.median(a / b for a, b in zip(times["this"], times["baseline"], strict=True))
    print(
        f"{workload} host-bound, checkpointing {args.checkpointing}, probe {args.probe}: {nodes} nodes, same graph "
        f"recorded: {same}"
    )
    print(f"  walk medians (us): {medians}; this / baseline, median of the steps' ratios: {ratio:.3f}")


if __name__ == "__main__":
    main()
