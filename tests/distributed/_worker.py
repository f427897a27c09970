"""Helpers for the distributed tests: 2 gloo processes on the CPU with a hard timeout, tiny nets, references.

A worker is a module-level function ``fn(rank, world, *args)`` run in every process after
``init_process_group("gloo")``; an exception in any process fails the test with that process's traceback, and
a run that outlives ``timeout`` is killed and fails (a hang never blocks CI).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gradroute
from tests._reference import reference_grads

WORLD = 2
ROWS = 4  # rows of a batch per rank
DTYPE = torch.float64


def _entry(rank: int, fn: Callable[..., None], world: int, store: str, args: tuple) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The work passed. Leave now: at interpreter exit, gloo's threads have been seen to abort the process
    # ("terminate called without an active exception") on a loaded machine, failing a run that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(fn: Callable[..., None], *args: Any, world: int = WORLD, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes; fail on an error or after ``timeout`` s."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world, os.path.join(tmp, "store"), args),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
                if time.monotonic() >= deadline:
                    pytest.fail(f"{fn.__name__} did not finish within {timeout:.0f} s (a hang?)", pytrace=False)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)


# ---------------------------------------------------------------------- models and data


def nets(dtype: torch.dtype = DTYPE) -> tuple[torch.nn.Sequential, torch.nn.Sequential]:
    """A tiny text encoder and UNet stand-in, identical in every process (seeded)."""
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(1234)
        tenc = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        unet = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    return tenc.to(dtype), unet.to(dtype)


def batch(
    step: int, world: int = WORLD, rank: int | None = None, dtype: torch.dtype = DTYPE
) -> tuple[torch.Tensor, ...]:
    """``x, target, mask`` of micro-batch ``step``: all ``world * ROWS`` rows, or rank ``rank``'s share."""
    g = torch.Generator().manual_seed(100 + step)
    n = world * ROWS
    x = torch.randn(n, 4, generator=g, dtype=dtype)
    target = torch.randn(n, 4, generator=g, dtype=dtype)
    mask = (torch.rand(n, 4, generator=g) > 0.5).to(dtype)
    if rank is None:
        return x, target, mask
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    return x[rows], target[rows], mask[rows]


def losses(
    forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, target: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The seed's routed losses: the text encoder on ``loss.mean()``, the UNet on ``(loss * mask).mean()``."""
    loss = torch.nn.functional.mse_loss(forward(x), target, reduction="none")
    return {"tenc": loss.mean(), "unet": (loss * mask).mean()}


def reference(step: int, world: int = WORLD, dtype: torch.dtype = DTYPE) -> dict[str, list[torch.Tensor]]:
    """Single-process full-batch routed gradients of micro-batch ``step``: a fresh forward per loss."""
    tenc, unet = nets(dtype)
    x, target, mask = batch(step, world, dtype=dtype)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    got = reference_grads(lambda: losses(lambda v: unet(tenc(v)), x, target, mask), groups)
    return {name: [got[id(p)] for p in params] for name, params in groups.items()}


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor gathered to a plain tensor; other tensors as they are."""
    return t.full_tensor() if t is not None and hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]


def assert_grads(
    modules: Mapping[str, torch.nn.Module], expected: Mapping[str, Sequence[torch.Tensor]], rtol: float, atol: float
) -> None:
    for name, module in modules.items():
        for (pname, p), want in zip(module.named_parameters(), expected[name], strict=True):
            got = full(p.grad)
            assert got is not None, f"{name}.{pname} got no gradient"
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, n=f"{name}.{pname}": f"{n}: {m}")


def gather(value: Any) -> list[Any]:
    """``value`` from every rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(x)))


class CheckpointedBody(torch.nn.Module):
    """A UNet stand-in: residual blocks run as one ``gradroute.checkpoint`` segment (or plainly)."""

    def __init__(self, checkpointed: bool, blocks: int = 6) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*(Residual() for _ in range(blocks)))
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gradroute.checkpoint(self.blocks, x) if self.checkpointed else self.blocks(x)


def checkpointed_pair() -> tuple[torch.nn.Module, CheckpointedBody, torch.nn.Module, CheckpointedBody]:
    """``tenc, unet`` (the UNet stand-in as one ``gradroute.checkpoint`` segment) and an identical un-checkpointed
    copy of both for the reference, the same in every process."""
    with torch.random.fork_rng():
        torch.manual_seed(5)
        tenc = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).double()
        unet = CheckpointedBody(True).double()
    ref_tenc = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).double()
    ref_unet = CheckpointedBody(False).double()
    ref_tenc.load_state_dict(tenc.state_dict())
    ref_unet.load_state_dict(unet.state_dict())
    return tenc, unet, ref_tenc, ref_unet
