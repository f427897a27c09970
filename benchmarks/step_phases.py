"""The whole training iteration of ``gradroute bench --step``, phase by phase, in CPU time.

    python benchmarks/step_phases.py [--workload sd-tiny|gan] [--width 8 --batch-size 1] [--steps 200]
                                     [--processes 3] [--static-graph] [--skip-nonfinite] [--floor]

The router's loop and the hand-written one (``gradroute.cli.bench.loops``: two fused AdamW, warmup+power
schedulers, clipping at 1.0, no scaler in fp32) take turns iteration by iteration; each phase (forward, routed
backward, step with zero_grad) is timed in CPU time of the calling thread, one torch thread, which other
processes do not inflate. Prints the medians per phase and the ratio of the iteration's summed medians;
``--processes N``: the median ratio over N processes. ``--skip-nonfinite``: the router with
``skip_nonfinite=True`` (an inf/NaN check of each group's norm before the step, which the hand-written loop does
not make).
``--floor``: instead of the router, the least this design does: the graph walk, the plan cache and the
executor's engine calls (gradroute internals), then the hand-written loop's step; no loss checks, statistics,
undo, non-finite skip or DDP checks. What the router costs above it is its guarantees and bookkeeping.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _processes import ratio_summary

import gradroute
from gradroute._execute import execute
from gradroute._planner import PlanCache
from gradroute._planner import build as build_program
from gradroute._types import Route
from gradroute.cli.bench.loops import SETUP, Loop, make_loop
from gradroute.cli.workloads import build

PHASES = ("forward", "backward", "step")


def hand(loop: Loop) -> tuple[float, float, float, float]:
    t0 = time.thread_time()
    h, loss_up, loss_down = loop.forward()
    t1 = time.thread_time()
    up, down = loop.params
    (g_h,) = torch.autograd.grad(loss_up, h, retain_graph=True)
    loss_down.backward(inputs=down)
    h.backward(g_h, inputs=up)
    del g_h, loss_up, loss_down
    t2 = time.thread_time()
    return t0, t1, t2, hand_step(loop)


_CACHE = PlanCache(size=8)
_PARAMS: dict[int, tuple[tuple[torch.Tensor, ...], ...]] = {}


def floor(loop: Loop) -> tuple[float, float, float, float]:
    """The walk, the cached plan and its engine calls (``--floor``), then the hand-written step."""
    t0 = time.thread_time()
    _, loss_up, loss_down = loop.forward()
    t1 = time.thread_time()
    up, down = _PARAMS.setdefault(id(loop), tuple(map(tuple, loop.params)))  # the same tuples every step
    routes = [Route(name="up", losses=(loss_up,), params=up), Route(name="down", losses=(loss_down,), params=down)]
    execute(build_program(routes, cache=_CACHE, probe=False), accumulate=True, watch=False)
    del routes, loss_up, loss_down
    t2 = time.thread_time()
    return t0, t1, t2, hand_step(loop)


def hand_step(loop: Loop) -> float:
    """The hand-written loop's step (clipping, optimizers, schedulers, zero_grad); returns the time it ended."""
    for params in loop.params:
        torch.nn.utils.clip_grad_norm_(params, SETUP["max_grad_norm"])
    for opt in loop.optimizers:
        opt.step()
    for sched in loop.schedulers:
        sched.step()
    for opt in loop.optimizers:
        opt.zero_grad(set_to_none=True)
    return time.thread_time()


def routed(loop: Loop) -> tuple[float, float, float, float]:
    assert loop.router is not None
    t0 = time.thread_time()
    _, loss_up, loss_down = loop.forward()
    t1 = time.thread_time()
    loop.router.backward(**{loop.wl.up_name: loss_up, loop.wl.down_name: loss_down})
    t2 = time.thread_time()
    loop.router.step()
    return t0, t1, t2, time.thread_time()


def run_once(args: argparse.Namespace) -> float:
    torch.set_num_threads(1)
    loops = {
        name: make_loop(
            name,
            build(args.workload, batch_size=args.batch_size, width=args.width),
            "fp32",
            scaler=False,
            static_graph=args.static_graph,
        )
        for name in ("hand_cut", "gradroute")
    }
    if args.skip_nonfinite:
        loop = loops["gradroute"]
        names = (loop.wl.up_name, loop.wl.down_name)
        groups = {
            n: gradroute.Group(p, optimizer=o, scheduler=s, max_grad_norm=SETUP["max_grad_norm"])
            for n, p, o, s in zip(names, loop.params, loop.optimizers, loop.schedulers)
        }
        loop.router = gradroute.Router(groups, static_graph=args.static_graph, skip_nonfinite=True)
    fns = {"hand_cut": hand, "gradroute": floor if args.floor else routed}
    times = {name: {ph: [] for ph in PHASES} for name in loops}
    for k in range(args.warmup + args.steps):
        for name in ("hand_cut", "gradroute") if k % 2 else ("gradroute", "hand_cut"):
            t = fns[name](loops[name])
            if k >= args.warmup:
                for ph, a, b in zip(PHASES, t, t[1:]):
                    times[name][ph].append(b - a)
    med = {n: {ph: statistics.median(v) * 1e3 for ph, v in per.items()} for n, per in times.items()}
    for n in loops:
        print(f"{n:10s} " + " ".join(f"{ph} {med[n][ph]:.3f} ms" for ph in PHASES))
    ratio = sum(med["gradroute"].values()) / sum(med["hand_cut"].values())
    print(f"ratio {ratio:.3f}")
    return ratio


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=["sd-tiny", "gan"], default="sd-tiny")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--static-graph", action="store_true")
    p.add_argument("--skip-nonfinite", action="store_true")
    p.add_argument("--floor", action="store_true")
    p.add_argument("--processes", type=int, default=1)
    args = p.parse_args()
    if args.processes > 1:
        summary = ratio_summary(args.processes, __file__)
        shape = f"{args.workload} width {args.width} batch {args.batch_size}"
        print(f"{args.processes} processes, {shape}: routed / hand {summary}")
        return
    run_once(args)


if __name__ == "__main__":
    main()
