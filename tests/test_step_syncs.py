"""``router.step()`` reads nothing from the device that the hand-written loop does not.

A ``TorchDispatchMode`` counts the operators that copy a value to the host (``aten._local_scalar_dense``:
``.item()``, ``float()``, ``bool()``; ``aten.nonzero``, ``aten.equal``, ``aten.is_nonzero``) in one step of the
seed's setup: two fused AdamW, warmup+power schedules, clipping at 1.0, one GradScaler. The reference is the
loop of torch's AMP notes for several optimizers: ``scaler.unscale_`` per optimizer, ``clip_grad_norm_``,
``scaler.step`` per optimizer, one ``update()``, the schedulers. On the CPU a read is no device sync, but it is
the same operator that waits for a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradroute
from gradroute.schedules import warmup_power

READS = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero"}


class CountReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def nets(seed: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def setup(fused: bool, scaler: bool, seed: int = 0) -> tuple[Any, ...]:
    tenc, unet = nets(seed)
    opts = [
        torch.optim.AdamW(m.parameters(), lr=1e-3, fused=fused, foreach=None if fused else True) for m in (tenc, unet)
    ]
    scheds = [warmup_power(o, warmup_steps=3, exponent=2.0, total_steps=10) for o in opts]
    amp = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaler else None
    return tenc, unet, opts, scheds, amp


def forward(tenc: nn.Module, unet: nn.Module, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    out = unet(tenc(x))
    return out.pow(2).mean(), (out - 1).abs().mean()


def hand_step(tenc: nn.Module, unet: nn.Module, opts: list, scheds: list, amp: Any, step: int) -> Callable[[], None]:
    loss_t, loss_u = forward(tenc, unet, step)
    scale = (lambda t: amp.scale(t)) if amp is not None else (lambda t: t)
    tenc_params, unet_params = list(tenc.parameters()), list(unet.parameters())
    g_t = torch.autograd.grad(scale(loss_t), tenc_params, retain_graph=True)
    g_u = torch.autograd.grad(scale(loss_u), unet_params)
    for p, g in zip([*tenc_params, *unet_params], [*g_t, *g_u], strict=True):
        p.grad = g

    def step_() -> None:
        for opt in opts:
            if amp is not None:
                amp.unscale_(opt)
        for params in (tenc_params, unet_params):
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        for opt in opts:
            if amp is not None:
                amp.step(opt)
            else:
                opt.step()
        if amp is not None:
            amp.update()
        for sched in scheds:
            sched.step()
        for opt in opts:
            opt.zero_grad(set_to_none=True)

    return step_


def routed_step(tenc: nn.Module, unet: nn.Module, router: gradroute.Router, step: int) -> Callable[[], Any]:
    loss_t, loss_u = forward(tenc, unet, step)
    router.backward(tenc=loss_t, unet=loss_u)
    return router.step


def count(fn: Callable[[], Any]) -> list[str]:
    with CountReads() as mode:
        fn()
    return mode.reads


@pytest.mark.parametrize("skip_nonfinite", [False, True])
@pytest.mark.parametrize("atomic_step", [True, False])
@pytest.mark.parametrize("scaler", [True, False])
def test_step_of_the_seed_setup_reads_no_more_than_the_hand_written_loop(
    scaler: bool, atomic_step: bool, skip_nonfinite: bool
) -> None:
    """``skip_nonfinite=True`` without a scaler skips on the device through the fused optimizer's ``found_inf``."""
    tenc, unet, opts, scheds, amp = setup(fused=True, scaler=scaler)
    h_tenc, h_unet, h_opts, h_scheds, h_amp = setup(fused=True, scaler=scaler)
    router = gradroute.Router(
        tenc=gradroute.Group(tenc, optimizer=opts[0], scheduler=scheds[0], max_grad_norm=1.0),
        unet=gradroute.Group(unet, optimizer=opts[1], scheduler=scheds[1], max_grad_norm=1.0),
        scaler=amp,
        atomic_step=atomic_step,
        skip_nonfinite=skip_nonfinite,
    )
    for step in range(3):  # the first step allocates the optimizers' state: count the third
        ours = count(routed_step(tenc, unet, router, step))
        hand = count(hand_step(h_tenc, h_unet, h_opts, h_scheds, h_amp, step))
    assert ours == hand
    # and it trained the same (the stats read now, after the count)
    for a, b in zip([*tenc.parameters(), *unet.parameters()], [*h_tenc.parameters(), *h_unet.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_stats_are_read_from_the_device_only_when_looked_at() -> None:
    tenc, unet, opts, scheds, amp = setup(fused=True, scaler=True)
    router = gradroute.Router(
        tenc=gradroute.Group(tenc, optimizer=opts[0], scheduler=scheds[0], max_grad_norm=1.0),
        unet=gradroute.Group(unet, optimizer=opts[1], scheduler=scheds[1]),
        scaler=amp,
    )
    stats = routed_step(tenc, unet, router, 0)()
    reads = count(lambda: (stats.scale, stats["tenc"].loss, stats["tenc"].grad_norm, stats["unet"].skipped))
    assert reads.count("_local_scalar_dense") == 4
    assert stats.scale == 2.0**8 and stats["unet"].skip_reason is None
    assert count(lambda: (stats.scale, stats["tenc"].loss, stats["unet"].skipped)) == []  # read once
