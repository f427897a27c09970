"""FLOPs of the routed backward through compiled modules, against the summed backward's (issue 18's measurement).

Two 3-layer MLPs (a "text encoder" and a "UNet", width ``--width`` -> ``2 * width`` -> ``width``), batch
``--batch``; ``loss = mse(unet(tenc(x)), target, reduction="none")``, ``tenc`` gets ``loss.mean()``, ``unet``
gets ``(loss * mask).mean()``. For eager modules, ``torch.compile(backend=B)`` and ``gradroute.compile(backend=B)``
it prints the FLOPs (``torch.utils.flop_counter.FlopCounterMode`` around the backward) of the routed backward
and of one backward of the summed losses, and their ratio. FLOPs are counted at the dispatcher, so only
``aot_eager`` (eager kernels) is meaningful; inductor's generated kernels are not all counted.

Run::

    python benchmarks/compile_flops.py                  # width 256, batch 64, aot_eager
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import gradroute


def _mlp(a: int, b: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, b), nn.ReLU(), nn.Linear(b, a))


def _flops(fn: Callable[[], Any]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def measure(
    tenc: Callable, unet: Callable, router: gradroute.Router, batch: tuple[torch.Tensor, ...]
) -> tuple[int, int]:
    """FLOPs of the summed backward and of the routed backward (each after its own forward)."""
    x, target, mask = batch

    def losses() -> tuple[torch.Tensor, torch.Tensor]:
        loss = F.mse_loss(unet(tenc(x)), target, reduction="none")
        return loss.mean(), (loss * mask).mean()

    lt, lu = losses()
    summed = _flops(lambda: (lt + lu).backward())
    router.zero_grad()
    lt, lu = losses()
    routed = _flops(lambda: router.backward(tenc=lt, unet=lu))
    router.zero_grad()
    return summed, routed


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor"))
    args = p.parse_args(argv)
    torch.manual_seed(0)
    tenc, unet = _mlp(args.width, 2 * args.width), _mlp(args.width, 2 * args.width)
    batch = (torch.randn(args.batch, args.width), torch.randn(args.batch, args.width))
    batch = (*batch, (torch.rand(args.batch, args.width) > 0.5).float())
    router = gradroute.Router(tenc=tenc, unet=unet)
    variants: dict[str, tuple[Callable, Callable]] = {
        "eager": (tenc, unet),
        "torch.compile": (torch.compile(tenc, backend=args.backend), torch.compile(unet, backend=args.backend)),
        "gradroute.compile": (
            gradroute.compile(tenc, backend=args.backend),
            gradroute.compile(unet, backend=args.backend),
        ),
    }
    print(f"torch {torch.__version__}, width {args.width}, batch {args.batch}, backend {args.backend}")
    print(f"{'modules':<20}{'sum GFLOP':>12}{'routed GFLOP':>14}{'routed / sum':>14}")
    for name, (t, u) in variants.items():
        # plain torch.compile needs donated_buffer=False for routed passes after a plain backward (examples/README.md)
        with torch._functorch.config.patch(donated_buffer=name != "torch.compile"):
            measure(t, u, router, batch)  # compiles (forward, backward, the variants)
            summed, routed = measure(t, u, router, batch)
        print(f"{name:<20}{summed / 1e9:>12.3f}{routed / 1e9:>14.3f}{routed / summed:>14.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
