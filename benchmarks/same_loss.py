"""One loss routed to both groups (DreamBooth without prior preservation) against one plain backward, in CPU time.

    python benchmarks/same_loss.py [--width 8 --batch-size 1] [--steps 60] [--processes 5] [--inputs]

sd-tiny's text encoder -> UNet, the UNet's loss routed to both groups (``router.backward(tenc=loss, unet=loss)``),
interleaved step by step with ``loss.backward()`` (forward included in both, CPU time of the calling thread, one
torch thread). Prints the medians and the ratio; ``--processes N``: the median ratio over N processes.
``--inputs``: the reference is ``loss.backward(inputs=<both groups' parameters>)`` instead, the floor of any
backward that writes the groups' parameters only (the engine then marks the nodes leading to them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _processes import ratio_summary

import gradroute
from gradroute.cli.workloads import build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--inputs", action="store_true")
    args = p.parse_args()
    if args.processes > 1:
        summary = ratio_summary(args.processes, __file__)
        reference = "plain with inputs=" if args.inputs else "plain"
        shape = f"width {args.width}, batch {args.batch_size}"
        print(f"{args.processes} processes: routed / {reference} {summary}; {shape}")
        return
    torch.set_num_threads(1)
    wl = build("sd-tiny", batch_size=args.batch_size, width=args.width)
    router = gradroute.Router(dict(wl.groups))
    params = [p for m in wl.groups.values() for p in m.parameters()]

    def plain() -> None:
        _, losses = wl.forward()
        losses[wl.down_name].backward(inputs=params if args.inputs else None)

    def routed() -> None:
        _, losses = wl.forward()
        loss = losses[wl.down_name]
        router.backward({wl.up_name: loss, wl.down_name: loss})

    times: dict[str, list[float]] = {"plain": [], "routed": []}
    order = [("plain", plain), ("routed", routed)]
    for k in range(args.warmup + args.steps):
        for name, fn in order if k % 2 else order[::-1]:
            for q in params:
                q.grad = None
            t = time.thread_time()
            fn()
            if k >= args.warmup:
                times[name].append(time.thread_time() - t)
    med = {n: statistics.median(v) for n, v in times.items()}
    ratio = med["routed"] / med["plain"]
    print(f"plain {med['plain'] * 1e3:.3f} ms, routed {med['routed'] * 1e3:.3f} ms, ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
