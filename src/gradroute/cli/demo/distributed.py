"""``gradroute demo`` under ``torchrun``: the process group, one DDP per network, each rank's rows."""

from __future__ import annotations

import os
from typing import Any

import torch


def init_distributed(dev: torch.device, batch_size: int) -> tuple[int, int, torch.device]:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1): join the process group and pick this rank's device.

    nccl on CUDA (device ``cuda:LOCAL_RANK``), gloo on the CPU. Returns ``(rank, world, device)``; ``(0, 1,
    dev)`` outside torchrun. Every rank draws the same global batch and trains on its own share of the rows.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, dev
    import atexit

    import torch.distributed as dist

    if batch_size % world:
        raise ValueError(f"`--batch-size` ({batch_size}) must be a multiple of the number of processes ({world})")
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        atexit.register(dist.destroy_process_group)
    return dist.get_rank(), dist.get_world_size(), dev


def wrap_ddp(tenc: torch.nn.Module, unet: torch.nn.Module, dev: torch.device, world: int) -> tuple[Any, Any]:
    """One ``DistributedDataParallel`` per network (each is its own group), or the modules when not distributed."""
    if world <= 1:
        return tenc, unet
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [dev.index] if dev.type == "cuda" else None
    return DDP(tenc, device_ids=ids), DDP(unet, device_ids=ids)


def shard(batch: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """This rank's contiguous share of the rows of ``batch`` (all of it when not distributed)."""
    if world <= 1:
        return batch
    n = len(batch["captions"]) // world
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}
