"""On the ``meta`` device, how much host work any exact route does beyond the summed backward: the hand cut.

    python benchmarks/meta_floor.py [--batch-size 8] [--steps 3] [--checkpointing cuts|gradroute|blocks]

SD-1.5 (the bench's ``sd15`` workload, 512 px, no checkpointing) on ``meta``: every op runs torch's Python meta
function and no kernel, so a backward's CPU time counts its ops. With ``--checkpointing KIND`` the models are
checkpointed as ``benchmarks/meta_host_time.py`` does (fused attention): the summed backward and the hand cut with
torch's checkpoint (what hand-written code has; the cut recomputes the UNet in two of its calls), the routers
with ``KIND``. Times, interleaved step by step (CPU time of the
calling thread, medians): the summed backward (wrong gradients: the floor), the hand-written ``cut``
(``grad(loss_tenc, hidden, retain_graph=True)``, ``loss_unet`` into the UNet, ``hidden`` into the text encoder:
the fewest ops of an exact route, one extra input-gradient chain through the UNet), and ``Router.backward``
without and with ``static_graph``. The ratio to the summed backward that no exact strategy beats is cut's.
Without checkpointing also ``batched``: the UNet's backward once with both losses' cotangents batched
(``is_grads_batched``), an exact route with fewer ops (each UNet backward op once, on two cotangents) but
vmap's host work per op.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from trace_memory import fused_attention

import gradroute
from gradroute.cli import workloads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--checkpointing", choices=("none", "cuts", "gradroute", "blocks"), default="none")
    args = p.parse_args()
    torch.set_num_threads(1)
    ckpt = args.checkpointing != "none"
    wl = workloads.build("sd15", batch_size=args.batch_size, device="meta", checkpointing=ckpt)
    with fused_attention(ckpt):
        run_all(wl, args.steps, args.checkpointing if ckpt else None)


def run_all(wl: workloads.Workload, steps: int, kind: str | None) -> None:
    """Time every strategy, interleaved step by step; ``kind``: the routers' checkpoint (the others: torch's)."""
    up, down = wl.up_name, wl.down_name
    routers = {"gradroute": gradroute.Router(**wl.groups), "static": gradroute.Router(**wl.groups, static_graph=True)}

    def cut() -> Callable[[], None]:
        h = wl.up(wl.batch)
        losses = wl.down(wl.batch, h, (up, down))

        def run() -> None:
            (g,) = torch.autograd.grad(losses[up], h, retain_graph=True)
            losses[down].backward(inputs=wl.params(down))
            h.backward(g, inputs=wl.params(up))

        return run

    def batched() -> Callable[[], None]:
        # the UNet's backward run once for both losses, their cotangents batched (``is_grads_batched``: vmap over
        # the backward), then the boundary gradient into the text encoder: each UNet backward op runs once, on
        # two cotangents (the UNet's weight gradients of ``loss_up`` are computed and dropped)
        h = wl.up(wl.batch)
        boundary = h.detach().requires_grad_()
        losses = wl.down(wl.batch, boundary, (up, down))
        params = list(wl.params(down))

        def run() -> None:
            out = torch.stack([losses[up], losses[down]])
            eye = torch.eye(2, device=out.device, dtype=out.dtype)
            gh, *gp = torch.autograd.grad(out, [boundary, *params], eye, is_grads_batched=True, allow_unused=True)
            for p, g in zip(params, gp, strict=True):
                if g is not None:
                    p.grad = g[1]
            h.backward(gh[0], inputs=wl.params(up))

        return run

    def summed() -> Callable[[], None]:
        losses = wl.forward()[1]
        return lambda: (losses[up] + losses[down]).backward()

    def routed(name: str) -> Callable[[], None]:
        losses = wl.forward()[1]
        return lambda: routers[name].backward(**losses)

    if wl.set_checkpoint is not None:
        wl.set_checkpoint(kind)
    for router in routers.values():  # the measured plan choice first, untimed (candidates only with checkpoints)
        for _ in range(30):
            router.backward(**wl.forward()[1])
            if not router.autotuning:
                break
    makes = {"sum": summed, "cut": cut, **{k: (lambda k=k: routed(k)) for k in routers}}
    if kind is None:  # vmap through torch's checkpoint is not what is asked here
        makes["batched"] = batched
    times: dict[str, list[float]] = {k: [] for k in makes}
    for step in range(steps + 2):  # two untimed: the routers walk twice before static_graph follows paths
        for name, make in makes.items():
            for m in wl.groups.values():
                m.zero_grad(set_to_none=True)
            if wl.set_checkpoint is not None:
                wl.set_checkpoint(kind if name in routers else "torch")
            run = make()
            t = time.thread_time()
            run()
            if step >= 2:
                times[name].append(time.thread_time() - t)
            del run
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:10s} {v * 1e3:8.0f} ms (backward)  {v / med['sum']:.3f}x sum  {v / med['cut']:.3f}x cut")


if __name__ == "__main__":
    main()
