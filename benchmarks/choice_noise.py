"""How often the measured plan choice keeps the fastest candidate, with the median or the minimum of its trials.

    python benchmarks/choice_noise.py [--checkpointing] [--repeats 40]

The host-bound sd-tiny step (width 8, batch 1, one thread). Each candidate plan of ``Autotune.default_candidates``
(with ``--checkpointing``: all of them, with ``gradroute.checkpoint``; without: the split plan and
``split=False``, what the choice measures there) has a router of its own with ``autotune=False``. One repeat is
what the measured choice does: 3 routed backwards per candidate, interleaved, each timed in process CPU time (the
choice's clock off CUDA). The fastest candidate is the one with the lowest median over all repeats; per repeat,
this reports which candidate the median of 3 and the minimum of 3 would keep, and the mean extra time of the
kept candidate over the fastest ("regret").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gradroute
from gradroute.cli.bench.runner import Runner
from gradroute.cli.workloads import build

TRIALS = 3  # gradroute.Autotune's default


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(1)
    wl = build("sd-tiny", batch_size=1, device=torch.device("cpu"), checkpointing=args.checkpointing, width=8)
    runner = Runner(wl, "fp32")
    runner.prepare("gradroute_ckpt")  # gradroute.checkpoint where the workload checkpoints
    base = gradroute.PlanOptions()
    split_only = (base, gradroute.PlanOptions(split=False))
    cands = gradroute.Autotune.default_candidates(base) if args.checkpointing else split_only
    routers = [gradroute.Router(dict(wl.groups), plan_options=o, autotune=False) for o in cands]

    def backward(k: int) -> float:
        runner.zero()
        _, up, down = runner.forward()
        t = time.process_time()
        routers[k].backward(**{wl.up_name: up, wl.down_name: down})
        return time.process_time() - t

    for _ in range(3):  # warm-up: plans built and cached
        for k in range(len(cands)):
            backward(k)
    every: list[list[float]] = [[] for _ in cands]
    kept: dict[str, list[int]] = {"median": [], "minimum": []}
    for _ in range(args.repeats):
        times: list[list[float]] = [[] for _ in cands]
        for _ in range(TRIALS):
            for k in range(len(cands)):
                times[k].append(backward(k))
        for k, ts in enumerate(times):
            every[k] += ts
        kept["median"].append(min(range(len(cands)), key=lambda k: statistics.median(times[k])))
        kept["minimum"].append(min(range(len(cands)), key=lambda k: min(times[k])))
    overall = [statistics.median(ts) for ts in every]
    best = min(range(len(cands)), key=overall.__getitem__)
    print(f"sd-tiny width 8 batch 1, checkpointing {args.checkpointing}, {args.repeats} repeats of {TRIALS} trials")
    for k, o in enumerate(cands):
        print(f"  #{k} {o}: {overall[k] * 1e3:.3f} ms{' <- fastest' if k == best else ''}")
    for name, picks in kept.items():
        regret = statistics.mean(overall[k] / overall[best] - 1 for k in picks)
        hits = sum(k == best for k in picks)
        print(f"{name} of {TRIALS}: kept the fastest {hits}/{len(picks)}, mean regret {regret:.2%}")


if __name__ == "__main__":
    main()
