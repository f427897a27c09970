"""The default ``router.step()`` allocates no more than the hand-written loop: no copy of parameters, gradients or
optimizer state (NOTE [Atomic step]); ``atomic_step="copy"`` costs one more copy of them (rule 5).

A dispatch mode follows every tensor storage alive during one step (those alive before it are registered:
parameters, gradients, optimizer state) and records the peak of their bytes above the bytes before the step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import gradroute


class LiveBytes(TorchDispatchMode):
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        for t in tensors:
            self._add(t)
        self.base = self.peak = self.live()

    def _add(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            self.refs.setdefault(s.data_ptr(), (StorageWeakRef(s), s.nbytes()))

    def live(self) -> int:
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        return sum(n for _, n in self.refs.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            self._add(t)
        self.peak = max(self.peak, self.live())
        return out


def make(fused: bool, scaler: bool) -> tuple[nn.Module, nn.Module, list[torch.optim.Optimizer], Any]:
    torch.manual_seed(0)
    tenc, unet = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=fused) for m in (tenc, unet)]
    return tenc, unet, opts, torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaler else None


def losses(tenc: nn.Module, unet: nn.Module, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = unet(torch.tanh(tenc(torch.randn(8, 64, generator=torch.Generator().manual_seed(k)))))
    return out.pow(2).mean(), (out - 1).abs().mean()


def state(mods: tuple[nn.Module, ...], opts: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    params = [p for m in mods for p in m.parameters()]
    out = [*params, *(p.grad for p in params if p.grad is not None)]
    return out + [v for o in opts for s in o.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def hand_peak(fused: bool, scaler: bool) -> tuple[int, int]:
    """The peak above the memory before it of torch's AMP recipe's step, and the parameters' bytes."""
    tenc, unet, opts, amp = make(fused, scaler)
    for k in range(3):
        loss_t, loss_u = losses(tenc, unet, k)
        scale = amp.scale if amp is not None else (lambda t: t)
        pt, pu = list(tenc.parameters()), list(unet.parameters())
        for p, g in zip(
            [*pt, *pu],
            [*torch.autograd.grad(scale(loss_t), pt, retain_graph=True), *torch.autograd.grad(scale(loss_u), pu)],
        ):
            p.grad = g
        with LiveBytes(state((tenc, unet), opts)) as mode:
            for opt in opts:
                if amp is not None:
                    amp.unscale_(opt)
            for m in (tenc, unet):
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            for opt in opts:
                amp.step(opt) if amp is not None else opt.step()
            if amp is not None:
                amp.update()
            for p in [*pt, *pu]:
                p.grad = None
    param_bytes = sum(p.numel() * p.element_size() for m in (tenc, unet) for p in m.parameters())
    return mode.peak - mode.base, param_bytes


def router_peak(fused: bool, scaler: bool, atomic_step: bool | str, skip_nonfinite: bool = False) -> int:
    tenc, unet, opts, amp = make(fused, scaler)
    router = gradroute.Router(
        tenc=gradroute.Group(tenc, optimizer=opts[0], max_grad_norm=1.0),
        unet=gradroute.Group(unet, optimizer=opts[1], max_grad_norm=1.0),
        scaler=amp,
        atomic_step=atomic_step,
        skip_nonfinite=skip_nonfinite,
    )
    for k in range(3):  # the third step: the optimizers' state exists before it
        loss_t, loss_u = losses(tenc, unet, k)
        router.backward(tenc=loss_t, unet=loss_u)
        with LiveBytes(state((tenc, unet), opts)) as mode:
            router.step()
    return mode.peak - mode.base


@pytest.mark.parametrize("scaler", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_default_step_peaks_no_higher_than_the_hand_written_loop(fused: bool, scaler: bool) -> None:
    hand, param_bytes = hand_peak(fused, scaler)
    scalars = 256  # the 0-dim tensors the step keeps for its stats: norms, found-inf records, the scale
    assert router_peak(fused, scaler, True) <= hand + scalars
    assert router_peak(fused, scaler, True, skip_nonfinite=True) <= hand + scalars
    assert router_peak(fused, scaler, False) <= hand + scalars
    # the copies (parameters, gradients, AdamW's two moments): about four times the parameters' bytes more
    assert router_peak(fused, scaler, "copy") >= hand + 3.5 * param_bytes
