"""FSDP2 (``fully_shard``) with routed losses: 2 gloo processes on the CPU against single-process references.

The registered parameters are sharded DTensors while the graph holds the unsharded ones; the router targets
the latter (``gradroute._distributed.live_params``) and FSDP2's hooks reduce-scatter them into the sharded
``.grad``, which gathered must equal the full-batch routed gradients of one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import gradroute
from gradroute import _compat
from gradroute._distributed import live_params
from tests._reference import reference_grads
from tests.distributed._worker import (
    assert_grads,
    batch,
    checkpointed_pair,
    full,
    gather,
    launch,
    losses,
    nets,
    reference,
)

pytestmark = pytest.mark.distributed

RELEASE = _compat._release(_compat.TORCH_VERSION)
#: FSDP2 runs on the CPU (gloo) from torch 2.7 (measured by ``make test-matrix``); before, it fails there in
#: torch itself, with or without gradroute: see ``_fails_on_the_cpu``
FSDP2_ON_CPU = RELEASE >= (2, 7)
#: what FSDP2 of the releases before raises on the CPU, in its first forward: 2.5's needs CUDA streams; 2.6's
#: all-gather records an event on a CPU stream, which has no ``record_event`` there
CPU_ERRORS: dict[tuple[int, int], tuple[type[Exception], str]] = {
    (2, 5): (RuntimeError, r"FSDP requires CUDA"),
    (2, 6): (AttributeError, r"'Stream' object has no attribute 'record_event'"),
}


def launch_fsdp(fn: Callable[..., None], *args: Any) -> None:
    """``launch(fn, *args)`` where this torch's FSDP2 runs on the CPU; elsewhere, check the error FSDP2 gives
    there."""
    if FSDP2_ON_CPU:
        launch(fn, *args)
    else:
        launch(_fails_on_the_cpu)


def _fails_on_the_cpu(rank: int, world: int) -> None:
    # torch's own FSDP2 fails (a plain forward and backward, no router): gradroute's FSDP2 support needs a torch
    # whose FSDP2 runs, on the CPU from 2.7
    tenc, unet = nets()
    forward = shard("per_network", tenc, unet)
    error, match = CPU_ERRORS[RELEASE]
    with pytest.raises(error, match=match):
        loss = losses(forward, *batch(0, world, rank))
        (loss["tenc"] + loss["unet"]).backward()


LAYOUTS = ("per_network", "per_layer", "one_root")


def shard(layout: str, tenc: torch.nn.Sequential, unet: torch.nn.Sequential) -> torch.nn.Module:
    """Apply ``fully_shard`` as ``layout`` says; return the module to call."""
    fully_shard = _compat.fully_shard()

    if layout in ("per_layer", "one_root"):
        for layer in (tenc[0], tenc[2], unet[0], unet[2]):
            fully_shard(layer)
    fully_shard(tenc)
    fully_shard(unet)
    chain = torch.nn.Sequential(tenc, unet)
    if layout == "one_root":
        fully_shard(chain)
    return chain


def _exact(rank: int, world: int) -> None:
    from torch.distributed.tensor import DTensor

    for layout in LAYOUTS:
        tenc, unet = nets()
        forward = shard(layout, tenc, unet)
        assert all(isinstance(p, DTensor) for p in [*tenc.parameters(), *unet.parameters()])
        router = gradroute.Router(tenc=tenc, unet=unet)
        for step in range(2):
            router.zero_grad()
            router.backward(losses(forward, *batch(step, world, rank)))
            assert_grads({"tenc": tenc, "unet": unet}, reference(step, world), rtol=1e-10, atol=1e-12)
        # grads(): the routed gradients of this rank's rows, unsharded and not reduced; .grad untouched
        router.zero_grad()
        got = router.grads(losses(forward, *batch(2, world, rank)))
        local = _reference_local(rank, world, 2)
        for name in ("tenc", "unet"):
            for g, want in zip(got[name], local[name], strict=True):
                torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)
        assert all(p.grad is None for p in [*tenc.parameters(), *unet.parameters()])
        router.backward(losses(forward, *batch(3, world, rank)))
        assert_grads({"tenc": tenc, "unet": unet}, reference(3, world), rtol=1e-10, atol=1e-12)
    _loss_head(rank, world)


class LossWeight(torch.nn.Module):
    """A learned weight used only in the text encoder's loss, sharded as its own FSDP2 root."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.5, 0.5], dtype=torch.float64))

    def forward(self) -> torch.Tensor:
        return self.w * 1.0


def _head_losses(fwd, lw: torch.nn.Module, x, target, mask) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    loss = torch.nn.functional.mse_loss(fwd(x), target, reduction="none")
    return {"tenc": (loss * lw().sum()).mean(), "unet": (loss * mask).mean()}


def _loss_head(rank: int, world: int) -> None:
    """A parameter at the loss head: its gradient is captured by a cutting call and delivered afterwards."""
    fully_shard = _compat.fully_shard()

    tenc, unet = nets()
    lw = LossWeight()
    for m in (tenc, unet, lw):
        fully_shard(m)
    router = gradroute.Router(tenc=[*tenc.parameters(), *lw.parameters()], unet=unet)
    ref_tenc, ref_unet = nets()
    ref_lw = LossWeight()
    for step in range(2):
        router.zero_grad()
        router.backward(_head_losses(lambda v: unet(tenc(v)), lw, *batch(step, world, rank)))
        routed = {"tenc": [*tenc.parameters(), *lw.parameters()], "unet": list(unet.parameters())}
        ref_params = {"tenc": [*ref_tenc.parameters(), *ref_lw.parameters()], "unet": list(ref_unet.parameters())}
        for name in ("tenc", "unet"):
            ref_loss = _head_losses(lambda v: ref_unet(ref_tenc(v)), ref_lw, *batch(step, world))[name]
            for p, want in zip(routed[name], torch.autograd.grad(ref_loss, ref_params[name]), strict=True):
                torch.testing.assert_close(full(p.grad), want, rtol=1e-10, atol=1e-12)


def _reference_local(rank: int, world: int, step: int) -> dict[str, list[torch.Tensor]]:
    tenc, unet = nets()
    x, target, mask = batch(step, world, rank)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    got = reference_grads(lambda: losses(lambda v: unet(tenc(v)), x, target, mask), groups)
    return {name: [got[id(p)] for p in params] for name, params in groups.items()}


def test_fsdp2_routed_backward_matches_full_batch_reference() -> None:
    """Sharding per network, per layer and network, under one root around both; ``grads()``; a loss-head weight."""
    launch_fsdp(_exact)


def _step(rank: int, world: int) -> None:
    lr, steps, micro = 0.1, 2, 2
    count = {"reduce_scatters": 0}
    # what FSDP2 reduce-scatters with: dist.reduce_scatter_single where torch has it, reduce_scatter_tensor before
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    reduce_scatter = getattr(dist, name)

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        count["reduce_scatters"] += 1
        return reduce_scatter(*args, **kwargs)

    setattr(dist, name, counted)
    tenc, unet = nets()
    forward = shard("per_network", tenc, unet)
    router = gradroute.Router(
        tenc=gradroute.Group(tenc, optimizer=torch.optim.SGD(tenc.parameters(), lr=lr), max_grad_norm=1e3),
        unet=gradroute.Group(unet, optimizer=torch.optim.SGD(unet.parameters(), lr=lr), max_grad_norm=1e3),
        accumulate=micro,
    )
    ref_tenc, ref_unet = nets()
    ref_chain = torch.nn.Sequential(ref_tenc, ref_unet)
    for step in range(steps):
        for k in range(micro):
            before = count["reduce_scatters"]
            router.backward(losses(forward, *batch(step * micro + k, world, rank)))
            stats = router.step()
            if k < micro - 1:  # FSDP2 keeps the unsharded gradients: no communication
                assert count["reduce_scatters"] == before, (step, k, count)
            else:
                # each network at least once; a network whose post-backward runs in an earlier engine call
                # than its own gradients is reduce-scattered twice (the earlier micro-batches' sum, then this
                # one's): exact, one extra reduce-scatter (docs/distributed.md)
                assert 2 <= count["reduce_scatters"] - before <= 4, (step, count)
        assert not stats.accumulating
        assert all(stats[n].grad_norm is not None and stats[n].grad_norm > 0 for n in ("tenc", "unet"))
        groups = {"tenc": list(ref_tenc.parameters()), "unet": list(ref_unet.parameters())}
        total: dict[int, torch.Tensor] = {}
        for k in range(micro):
            x, target, mask = batch(step * micro + k, world)
            got = reference_grads(lambda x=x, t=target, m=mask: losses(ref_chain, x, t, m), groups)
            for key, g in got.items():
                total[key] = g if key not in total else total[key] + g
        with torch.no_grad():
            for params in groups.values():
                for p in params:
                    p -= lr * total[id(p)] / micro
        for mod, ref_mod in ((tenc, ref_tenc), (unet, ref_unet)):
            for p, q in zip(mod.parameters(), ref_mod.parameters(), strict=True):
                torch.testing.assert_close(full(p.detach()), q, rtol=1e-10, atol=1e-12)


def test_fsdp2_accumulation_and_step_match_reference() -> None:
    """``accumulate=2`` with SGD and clipping; FSDP2 communicates only on the last micro-batch of a step."""
    launch_fsdp(_step)


def _inf_in_one_shard(rank: int, world: int, scaled: bool) -> None:
    tenc, unet = nets(torch.float32)
    forward = shard("per_network", tenc, unet)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaled else None
    router = gradroute.Router(
        tenc=gradroute.Group(tenc, optimizer=torch.optim.SGD(tenc.parameters(), lr=0.1)),
        unet=gradroute.Group(unet, optimizer=torch.optim.SGD(unet.parameters(), lr=0.1)),
        scaler=scaler,
        skip_nonfinite=not scaled,
    )
    before = [full(p.detach()).clone() for p in unet.parameters()]
    router.backward(losses(forward, *batch(0, world, rank, dtype=torch.float32)))
    if rank == 0:  # an inf in rank 0's shard of one UNet gradient only: each rank checks its own shard
        with torch.no_grad():
            unet[0].weight.grad.to_local().view(-1)[0] = float("inf")
    stats = router.step()
    assert gather((stats["tenc"].skipped, stats["unet"].skipped)) == [(False, True)] * world
    if scaler is not None:
        assert gather(float(scaler.get_scale())) == [2.0**7] * world
    for p, q in zip(unet.parameters(), before, strict=True):
        torch.testing.assert_close(full(p.detach()), q, rtol=0, atol=0)


@pytest.mark.parametrize("scaled", [True, False], ids=["GradScaler", "skip_nonfinite"])
def test_fsdp2_inf_in_one_shard_skips_that_group_on_every_rank(scaled: bool) -> None:
    """With a GradScaler, or without one and ``skip_nonfinite=True``."""
    launch_fsdp(_inf_in_one_shard, scaled)


def test_live_params_of_plain_parameters_is_the_same_tuple() -> None:
    params = tuple(torch.nn.Linear(2, 2).parameters())
    assert live_params(params) is params


def _checkpointed(rank: int, world: int) -> None:
    fully_shard = _compat.fully_shard()

    # small chunks: several interleaved calls through the segment, each delivering some of the UNet's grads
    options = gradroute.PlanOptions(chunk=6)
    for per_block in (False, True):
        tenc, unet, ref_tenc, ref_unet = checkpointed_pair()
        if per_block:  # FSDP2 per block inside the checkpointed segment, as for transformer blocks
            for block in unet.blocks:
                fully_shard(block)
        fully_shard(tenc)
        fully_shard(unet)
        router = gradroute.Router(tenc=tenc, unet=unet, plan_options=options)
        groups = {"tenc": list(ref_tenc.parameters()), "unet": list(ref_unet.parameters())}
        ref, model = torch.nn.Sequential(ref_tenc, ref_unet), torch.nn.Sequential(tenc, unet)
        # FSDP2 reduce-scatters a module's gradients at the end of the first engine call that computes any of
        # them: the UNet pass stays one call (a chunked pass lost blocks.0's gradients)
        plan = router.plan(losses(model, *batch(0, world, rank)))
        assert sum(c.groups == ("unet",) for c in plan.calls) == 1 and not plan.notes, plan
        for step in range(2):
            router.zero_grad()
            router.backward(losses(model, *batch(step, world, rank)))
            want = reference_grads(lambda s=step, ref=ref: losses(ref, *batch(s, world)), groups)
            expected = {name: [want[id(p)] for p in params] for name, params in groups.items()}
            assert_grads({"tenc": tenc, "unet": unet}, expected, rtol=1e-10, atol=1e-12)


def test_fsdp2_checkpointed_segment_matches_full_batch_reference() -> None:
    """``fully_shard`` per network and per block inside a ``gradroute.checkpoint`` segment: the shared
    recomputation unshards, and every shard gets its reduced gradient once (the passes are not interleaved)."""
    launch_fsdp(_checkpointed)
