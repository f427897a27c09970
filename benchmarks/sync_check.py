"""The training iteration of ``gradroute bench --step`` under ``torch.cuda.set_sync_debug_mode("error")``.

    python benchmarks/sync_check.py [--workload sd-tiny] [--steps 5] [--dtype fp16|bf16]

The bench's two loops (``gradroute.cli.bench.loops``: two fused AdamW, warmup+power schedulers, clipping at 1.0,
one GradScaler in fp16): the hand-written one, torch's AMP recipe, runs first under the same mode as the control,
then the router's. Any synchronizing call raises; the script prints ``OK`` per loop, or the error. Needs CUDA
(GPU runs: benchmarks/gpu.sh).
"""

from __future__ import annotations

import argparse

import torch

from gradroute.cli.bench.loops import Loop, make_loop
from gradroute.cli.workloads import build


def check(loop: Loop, steps: int) -> None:
    """``steps`` iterations of ``loop`` with every synchronizing call an error, after the measured plan choice
    (which times its trials: it synchronizes) and two warm-up iterations."""
    loop.settle()
    for _ in range(2):
        loop.iterate()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            loop.iterate()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=["sd-tiny", "gan"], default="sd-tiny")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    args = p.parse_args()
    failed = False
    for name in ("hand_cut", "gradroute"):
        wl = build(args.workload, device="cuda")
        loop = make_loop(name, wl, args.dtype, scaler=args.dtype == "fp16")
        try:
            check(loop, args.steps)
            print(f"{name}, {args.workload}, {args.dtype}: OK (no host sync in {args.steps} iterations)")
        except RuntimeError as e:
            failed = True
            print(f"{name}, {args.workload}, {args.dtype}: FAILED: {e}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
