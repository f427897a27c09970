"""A plain PyTorch loop (one optimizer over both networks, GradScaler, accumulation, DDP), routed.

The lines marked ``# gradroute`` are the change: the router replaces ``scaler.scale(loss / N).backward()``; the
optimizer, the unscale/clip/step/update and DDP's ``no_sync`` stay the script's. The models and data are the
stand-ins of ``tiny.py``.

Run::

    python docs/recipes/torch_loop.py --accumulation 2 --amp bf16
    torchrun --nproc-per-node 2 docs/recipes/torch_loop.py --accumulation 2   # gloo on the CPU, nccl on GPUs
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
from collections.abc import Sequence

import text_to_image
import tiny
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradroute  # gradroute


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--amp", choices=("no", "fp16", "bf16"), default="no")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--max_steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and not dist.is_initialized():  # under torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu")
    text_encoder, unet, noise_scheduler = tiny.models()
    text_encoder, unet = text_encoder.to(device), unet.to(device)
    if args.gradient_checkpointing:
        gradroute.enable_checkpointing(text_encoder)  # gradroute: was text_encoder.gradient_checkpointing_enable()
        gradroute.enable_checkpointing(unet)  # gradroute: was unet.enable_gradient_checkpointing()
    optimizer = torch.optim.AdamW(itertools.chain(unet.parameters(), text_encoder.parameters()), lr=args.lr)
    tenc, net = (DDP(text_encoder), DDP(unet)) if distributed else (text_encoder, unet)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    router = gradroute.Router(tenc=text_encoder, unet=unet, scaler=scaler)  # gradroute
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)
    batches = list(torch.utils.data.DataLoader(tiny.dataset(), batch_size=args.batch_size, shuffle=False))
    stream = itertools.cycle(batches[rank::world])  # each process its own batches (a DistributedSampler's job)

    for micro in range(args.max_steps * args.accumulation):
        batch = {k: v.to(device) for k, v in next(stream).items()}
        last = (micro + 1) % args.accumulation == 0
        with contextlib.ExitStack() as no_sync:
            if distributed and not last:  # DDP: all-reduce on the last micro-batch only
                no_sync.enter_context(tenc.no_sync())
                no_sync.enter_context(net.no_sync())
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss_tenc, loss_unet = text_to_image.compute_losses(tenc, net, noise_scheduler, batch)
            n = args.accumulation
            router.backward(tenc=loss_tenc / n, unet=loss_unet / n)  # gradroute: was scaler.scale(loss / n).backward()
        if last:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(
                itertools.chain(unet.parameters(), text_encoder.parameters()), args.max_grad_norm
            )
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0:
                print(f"step {(micro + 1) // n}: unet loss {loss_unet.item():.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
