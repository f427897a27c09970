"""The bench's host-bound steps in CPU time: every strategy against the faster hand-written one, step by step.

    python benchmarks/host_step.py [--checkpointing] [--steps 60]

``gradroute bench --workload sd-tiny --width 8 --batch-size 1 --threads 1`` times wall clock, which a shared
machine inflates at random (another process's burst lands on one strategy's step). This runs the same steps
(the bench's ``Runner`` and strategy functions: forward + backward) interleaved, and times each with the CPU
time of the calling thread (with one torch thread the CPU engine runs there), which other processes do not
inflate. Per strategy: the median step, and its ratio to the faster median of ``pruned`` and ``cut`` (as the
bench reports it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gradroute.cli.bench.runner import Runner
from gradroute.cli.choices import CKPT_STRATEGIES
from gradroute.cli.workloads import build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    wl = build("sd-tiny", batch_size=1, device=torch.device("cpu"), checkpointing=args.checkpointing, width=8)
    r = Runner(wl, "fp32")
    strategies = ["sum", "pruned", "cut", "gradroute", "gradroute_static"]
    if args.checkpointing:
        strategies += list(CKPT_STRATEGIES)
    for s in strategies:
        r.settle(s)  # the measured plan choice, untimed
    times: dict[str, list[float]] = {s: [] for s in strategies}
    for k in range(args.warmup + args.steps):
        for s in strategies:
            r.prepare(s)
            r.zero()
            t = time.thread_time()
            r.step(s)
            if k >= args.warmup:
                times[s].append(time.thread_time() - t)
    r.zero()
    med = {s: statistics.median(v) for s, v in times.items()}
    hand = min(med["pruned"], med["cut"])
    print(f"sd-tiny width 8 batch 1, 1 thread, checkpointing {args.checkpointing}, {args.steps} rounds (CPU time)")
    print("| strategy | median ms | / faster of pruned, cut |")
    print("|---|---|---|")
    for s in strategies:
        print(f"| {s} | {med[s] * 1e3:.2f} | {med[s] / hand:.3f} |")


if __name__ == "__main__":
    main()
