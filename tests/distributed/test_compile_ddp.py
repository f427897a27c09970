"""DDP with ``gradroute.compile``d networks: 2 gloo processes against the single-process full-batch reference."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradroute
from tests.distributed._worker import assert_grads, batch, launch, losses, nets, reference
from tests.distributed.test_ddp import Chain

pytestmark = pytest.mark.distributed


def _compiled(rank: int, world: int) -> None:
    # one DDP per network around the compiled UNet, and one DDP around both (the UNet compiled inside)
    for layout in ("per_network", "one_ddp"):
        torch._dynamo.reset()
        tenc, unet = nets()
        compiled = gradroute.compile(unet, backend="aot_eager")
        if layout == "per_network":
            d_tenc, d_unet = DDP(tenc), DDP(compiled)
            forward = lambda x, d_tenc=d_tenc, d_unet=d_unet: d_unet(d_tenc(x))  # noqa: E731
        else:
            forward = d_tenc = d_unet = DDP(Chain(tenc, compiled))
        router = gradroute.Router(tenc=gradroute.Group(tenc, ddp=d_tenc), unet=gradroute.Group(unet, ddp=d_unet))
        for step in range(2):
            router.zero_grad()
            router.backward(losses(forward, *batch(step, world, rank)))
            assert_grads({"tenc": tenc, "unet": unet}, reference(step, world), rtol=1e-10, atol=1e-12)
        st = gradroute.compile_stats(compiled)
        assert st is not None and st.backwards == 1 and st.variants == 2, (layout, st)  # pruned: 2 masks, no full
        assert st.unaligned == 0 and () not in st.masks, (layout, st)
    torch._dynamo.reset()


def _compiled_around_ddp(rank: int, world: int) -> None:
    # the other order: DDP inside, compiled around it (dynamo's DDP optimizer splits the graph at buckets)
    for compile_fn in (gradroute.compile, torch.compile):
        torch._dynamo.reset()
        tenc, unet = nets()
        d_unet_ddp = DDP(unet)
        d_tenc, d_unet = DDP(tenc), compile_fn(d_unet_ddp, backend="aot_eager")
        router = gradroute.Router(tenc=gradroute.Group(tenc, ddp=d_tenc), unet=gradroute.Group(unet, ddp=d_unet_ddp))
        for step in range(2):
            router.zero_grad()
            router.backward(losses(lambda x: d_unet(d_tenc(x)), *batch(step, world, rank)))  # noqa: B023
            assert_grads({"tenc": tenc, "unet": unet}, reference(step, world), rtol=1e-10, atol=1e-12)
    torch._dynamo.reset()


def test_ddp_with_compiled_unet_matches_full_batch_reference() -> None:
    launch(_compiled, timeout=300.0)


def test_compiled_ddp_unet_matches_full_batch_reference() -> None:
    launch(_compiled_around_ddp, timeout=300.0)
