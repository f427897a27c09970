"""What the recipes' tests share: the recipes importable, the optimizer steps recorded, per-step references.

A recipe is run as written; a global optimizer step pre-hook (``torch.optim.optimizer.
register_optimizer_step_pre_hook``) records, at every real optimizer step, the parameters and their gradients
(unscaled, clipped: what the optimizer is about to apply). The reference for a step starts from the recorded
parameters, takes a fresh forward per loss and ``torch.autograd.grad`` on each micro-batch of each process,
averages as Accelerate's ``backward`` and DDP do, and clips as ``accelerator.clip_grad_norm_`` does.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tests._reference import reference_grads

RECIPES = Path(__file__).resolve().parents[2] / "docs" / "recipes"
if str(RECIPES) not in sys.path:
    sys.path.insert(0, str(RECIPES))

Record = list[tuple[torch.Tensor, torch.Tensor | None]]


@contextlib.contextmanager
def recorded_steps() -> Iterator[list[Record]]:
    """Every optimizer step taken inside: ``[(parameter, grad), ...]`` in the optimizer's order, before the step."""
    records: list[Record] = []

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        records.append(
            [
                (p.detach().cpu().clone(), None if p.grad is None else p.grad.detach().cpu().clone())
                for group in optimizer.param_groups
                for p in group["params"]
            ]
        )

    handle = register_optimizer_step_pre_hook(hook)
    try:
        yield records
    finally:
        handle.remove()


def micro_batches(batch_size: int, *, world: int = 1, rank: int = 0, n: int = 8) -> Iterator[dict[str, Any]]:
    """The micro-batches one process sees, epoch after epoch (no shuffling; Accelerate deals batches round-robin)."""
    import tiny

    loader = list(torch.utils.data.DataLoader(tiny.dataset(n), batch_size=batch_size, shuffle=False))
    mine = loader[rank::world]
    while True:
        yield from mine


def reference_step(
    record: Record,
    params: Sequence[torch.Tensor],
    groups: dict[str, Sequence[torch.Tensor]],
    forward: Callable[[dict[str, Any]], dict[str, torch.Tensor]],
    batches_per_rank: Sequence[Sequence[dict[str, Any]]],
    *,
    accumulation: int,
    max_grad_norm: float | None,
) -> list[torch.Tensor]:
    """The gradients a step should apply: ``params`` (the reference models' parameters, in the optimizer's order)
    are set to the recorded values, each loss gets a fresh forward per micro-batch, divided by ``accumulation``
    and averaged over the processes; then clipped as one total norm."""
    assert len(record) == len(params)
    with torch.no_grad():
        for p, (value, _) in zip(params, record, strict=True):
            p.copy_(value)
    total = [torch.zeros_like(p) for p in params]
    index = {id(p): k for k, p in enumerate(params)}
    world = len(batches_per_rank)
    for batches in batches_per_rank:
        for batch in batches:
            for pid, g in reference_grads(lambda batch=batch: forward(batch), groups).items():
                total[index[pid]] += g / (accumulation * world)
    if max_grad_norm is not None:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in total]))
        total = [g * torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0) for g in total]
    return total


def assert_step_matches(record: Record, expected: Sequence[torch.Tensor], *, rtol: float, atol: float) -> None:
    for k, ((_, got), want) in enumerate(zip(record, expected, strict=True)):
        assert got is not None, f"parameter {k} has no gradient at the step"
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, k=k: f"parameter {k}: {m}")
