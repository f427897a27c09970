"""The frame and its recomputation: once per routed backward, what it frees and when, determinism."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointError

import gradroute

from ._helpers import CKS, D, backward_sampling_live, losses, make, recomputed


@pytest.mark.parametrize(("ck", "unet_recomputes"), [("gradroute", 1), ("torch", 2)])
def test_each_segment_recomputed_once_per_routed_backward(ck: str, unet_recomputes: int) -> None:
    # both passes go through every unet block; only the text-encoder pass goes through tenc's blocks
    tenc, unet = make()
    router = gradroute.Router(tenc=tenc, unet=unet, autotune=False)  # the default plan on every call
    for step in range(1, 3):
        router.backward(**losses(tenc, unet, CKS[ck]))
        assert recomputed(unet) == [step * unet_recomputes] * 3
        assert recomputed(tenc) == [step] * 2


def test_recomputed_tensors_freed_after_backward() -> None:
    tenc, unet = make()
    ls = losses(tenc, unet, gradroute.checkpoint)
    gradroute.Router(tenc=tenc, unet=unet).backward(**ls)
    made = [s for b in [*tenc.blocks, *unet.blocks] for s in b.storages]
    assert len(made) == 2 * 5
    assert all(s.expired() for s in made)  # while ``ls`` still holds the (freed) graph


@pytest.mark.parametrize("routed", [True, False])
def test_graph_and_segment_inputs_freed_without_the_cycle_collector(routed: bool) -> None:
    # the segment inputs (kept for the recomputation) must go with the graph by reference counting alone: a
    # reference cycle would keep a step's boundaries alive into the next steps until the collector runs
    # (torch's own non-reentrant checkpoint does not pass this with a plain backward, torch 2.13)
    tenc, unet = make()
    router = gradroute.Router(tenc=tenc, unet=unet)
    x = torch.randn(5, D, dtype=torch.float64)
    gc.disable()
    try:
        h = tenc(x, gradroute.checkpoint)
        inputs = StorageWeakRef(h.untyped_storage())
        loss = unet(h, gradroute.checkpoint) ** 2
        if routed:
            router.backward(tenc=loss.mean(), unet=loss.sum())
        else:
            (loss.mean() + loss.sum()).backward()
        del h, loss
        assert inputs.expired()
    finally:
        gc.enable()


def test_nondeterministic_segment_fails() -> None:
    calls = []

    def f(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.sin(t) if len(calls) == 1 else t * 2  # saves one tensor, then none when recomputed

    y = gradroute.checkpoint(f, torch.randn(3, requires_grad=True))
    with pytest.raises(CheckpointError, match="different number of tensors"):
        y.sum().backward()


def test_segment_inputs_freed_with_their_segment_not_at_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    # a segment keeps its inputs for the recomputation; they must go once the segment's nodes are freed by
    # their last call, not when the router call returns (they are most of a checkpointed forward's memory)
    tenc, unet = make()
    inputs: list[StorageWeakRef] = []

    def recording(fn: Callable[..., Any], x: torch.Tensor) -> Any:
        inputs.append(StorageWeakRef(x.untyped_storage()))
        return gradroute.checkpoint(fn, x)

    ls = losses(tenc, unet, recording)
    n = len(inputs)
    live = backward_sampling_live(
        monkeypatch, gradroute.Router(tenc=tenc, unet=unet), ls, lambda: sum(not s.expired() for s in inputs)
    )
    del ls
    # freed one by one as the passes go down (after each of the three unet blocks' last call, ...)
    assert n == 5 and live == sorted(live, reverse=True) and live[-2] <= 2 and live[-1] == 0, live
