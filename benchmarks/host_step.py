"""The bench's host-bound steps in CPU time: every strategy against the faster hand-written one, step by step.

    python benchmarks/host_step.py [--checkpointing] [--steps 60] [--processes 10]
    python benchmarks/host_step.py --width 32 --batch-size 16 [--checkpointing]   # the compute-bound regime

``gradroute bench --workload sd-tiny --width 8 --batch-size 1 --threads 1`` times wall clock, which a shared
machine inflates at random (another process's burst lands on one strategy's step). This runs the same steps
(the bench's ``Runner`` and strategy functions: forward + backward; every ``gradroute*`` strategy with and without
``Router(static_graph=True)``) interleaved, and times each with the CPU
time of the calling thread (with one torch thread the CPU engine runs there), which other processes do not
inflate. Per strategy: the median step, and its ratio to the faster median of ``pruned`` and ``cut`` (as the
bench reports it). The strategies take turns going first (round ``k`` starts ``k`` places further down the list):
with one order for every round, a strategy's place in it moved its ratio by several percent on our machine.

``--processes N`` runs N such processes one after another and reports, per strategy, the median and the range
of their ratios: one process's ratios carry a bias fixed for that process (on our machine, the two hand-written
strategies, which do the same engine work, differed by up to 10% in one process and by 0.5% in the next).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _processes import outputs

from gradroute.cli.bench.runner import Runner
from gradroute.cli.choices import CKPT_STRATEGIES
from gradroute.cli.workloads import build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--width", type=int, default=8, help="the UNet's base channels (the bench's default: 32)")
    p.add_argument("--batch-size", type=int, default=1, help="(the bench's default: 16)")
    p.add_argument("--processes", type=int, default=1, help="run this many processes; medians of their ratios")
    args = p.parse_args()
    if args.processes > 1:
        _over_processes(args.processes)
        return
    torch.set_num_threads(1)
    wl = build(
        "sd-tiny",
        batch_size=args.batch_size,
        device=torch.device("cpu"),
        checkpointing=args.checkpointing,
        width=args.width,
    )
    # every gradroute strategy twice: with the router's defaults, and with static_graph (a router each)
    runners = {"": Runner(wl, "fp32"), " (static_graph)": Runner(wl, "fp32", static_graph=True)}
    gradroute = ["gradroute", *(CKPT_STRATEGIES if args.checkpointing else ())]
    rows = [("", s) for s in ("sum", "pruned", "cut")] + [(m, s) for m in runners for s in gradroute]
    chosen = {}
    for mode, s in rows:
        note = runners[mode].settle(s)  # the measured plan choice, untimed
        if note:
            chosen[s + mode] = next((ln.strip() for ln in note.splitlines() if ln.endswith("<- chosen")), note)
    times: dict[str, list[float]] = {s + mode: [] for mode, s in rows}
    for k in range(args.warmup + args.steps):
        turn = k % len(rows)
        for mode, s in rows[turn:] + rows[:turn]:
            r = runners[mode]
            r.prepare(s)
            r.zero()
            t = time.thread_time()
            r.step(s)
            if k >= args.warmup:
                times[s + mode].append(time.thread_time() - t)
    r.zero()
    med = {s: statistics.median(v) for s, v in times.items()}
    hand = min(med["pruned"], med["cut"])
    print(
        f"sd-tiny width {args.width} batch {args.batch_size}, 1 thread, checkpointing {args.checkpointing}, "
        f"{args.steps} rounds (CPU time)"
    )
    print("| strategy | median ms | / faster of pruned, cut |")
    print("|---|---|---|")
    for s, v in med.items():
        print(f"| {s} | {v * 1e3:.2f} | {v / hand:.3f} |")
    for s, line in chosen.items():
        print(f"{s}, measured plan choice: {line}")


def _over_processes(n: int) -> None:
    """Run this script ``n`` times (the other arguments passed on); print each strategy's median ratio and range."""
    runs, argv = outputs(n, __file__)
    ratios: dict[str, list[float]] = {}
    for out in runs:
        for line in out.splitlines():
            cells = [c.strip() for c in line.strip("|").split("|")]
            if line.startswith("| ") and len(cells) == 3 and cells[0] != "strategy":
                ratios.setdefault(cells[0], []).append(float(cells[2]))
    print(f"{n} processes of: host_step.py {' '.join(argv)}")
    print("| strategy | / faster of pruned, cut: median of the processes | range |")
    print("|---|---|---|")
    for name, values in ratios.items():
        print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f}-{max(values):.3f} |")


if __name__ == "__main__":
    main()
