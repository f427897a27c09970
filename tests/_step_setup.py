"""The two networks, optimizers, schedulers and scaler the training-step tests share, and the reference step.

The reference follows PyTorch's AMP notes ("Working with multiple models, losses, and optimizers") line by line,
with an independent forward per loss; it never calls gradroute.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import gradroute
from gradroute.schedules import warmup_power

INF = float("inf")


def make_nets(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    tenc = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)).to(dtype)
    unet = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).to(dtype)
    return tenc, unet


def make_batches(n: int, size: int = 8, seed: int = 1, dtype: torch.dtype = torch.float32) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, 4, generator=g).to(dtype),
            torch.randn(size, 4, generator=g).to(dtype),
            (torch.rand(size, 4, generator=g) > 0.5).to(dtype),
        )
        for _ in range(n)
    ]


#: name -> (autocast dtype or None, GradScaler kwargs or None for no scaler)
PRECISIONS: dict[str, tuple[torch.dtype | None, dict | None]] = {
    "fp32": (None, None),
    "bf16": (torch.bfloat16, None),
    "fp16-scaler": (torch.float16, {}),
    "bf16-scaler": (torch.bfloat16, {}),
    "fp32-disabled-scaler": (None, {"enabled": False}),
}


def autocast(dtype: torch.dtype | None) -> Any:
    return contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)


def make_scaler(kwargs: dict | None) -> torch.amp.GradScaler | None:
    return None if kwargs is None else torch.amp.GradScaler("cpu", **kwargs)


def seed_optimizers(tenc: nn.Module, unet: nn.Module, kind: str) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """The optimizers of docs/training_step.md (kind "seed") or bigger-lr variants (updates visible in float32)."""
    if kind == "seed":
        common = {"betas": (0.9, 0.99), "eps": 1e-07, "fused": True, "foreach": False}
        return (
            torch.optim.AdamW(tenc.parameters(), lr=1e-07, weight_decay=1e-3, **common),
            torch.optim.AdamW(unet.parameters(), lr=1e-06, weight_decay=1e-2, **common),
        )
    if kind == "sgd":
        return (
            torch.optim.SGD(tenc.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
            torch.optim.SGD(unet.parameters(), lr=0.2, momentum=0.9, weight_decay=1e-2),
        )
    flags = {"adamw-fused": {"fused": True}, "adamw-foreach": {"foreach": True}}[kind]
    return (
        torch.optim.AdamW(tenc.parameters(), lr=1e-2, weight_decay=1e-3, betas=(0.9, 0.99), eps=1e-7, **flags),
        torch.optim.AdamW(unet.parameters(), lr=2e-2, weight_decay=1e-2, betas=(0.9, 0.99), eps=1e-7, **flags),
    )


def losses(tenc: nn.Module, unet: nn.Module, batch: tuple, dtype: torch.dtype | None, inf_unet: bool = False):
    """The two losses of docs/training_step.md, from one forward: ``loss.mean()`` and ``(loss * mask).mean()``."""
    x, target, mask = batch
    with autocast(dtype):
        model_pred = unet(tenc(x))
        loss = F.mse_loss(model_pred, target, reduction="none")
        loss_tenc = loss.mean()
        loss_unet = (loss * mask).mean()
    if inf_unet:
        loss_unet = loss_unet * INF
    return loss_tenc, loss_unet


def loss_dict(tenc: nn.Module, unet: nn.Module, batch: tuple, dtype: torch.dtype | None) -> dict:
    loss_tenc, loss_unet = losses(tenc, unet, batch, dtype)
    return {"tenc": loss_tenc, "unet": loss_unet}


class Setup:
    """Two networks, two optimizers, two warmup_power schedulers, one optional GradScaler."""

    def __init__(self, opt_kind: str, precision: str, seed: int = 0, schedule: tuple = (2, 2.0, 6)) -> None:
        self.dtype, scaler_kwargs = PRECISIONS[precision]
        self.tenc, self.unet = make_nets(seed)
        self.opt_t, self.opt_u = seed_optimizers(self.tenc, self.unet, opt_kind)
        self.sched_t = warmup_power(self.opt_t, *schedule)
        self.sched_u = warmup_power(self.opt_u, *schedule)
        self.scaler = make_scaler(scaler_kwargs)

    def router(self, max_t: float | None = None, max_u: float | None = None, **kw: Any) -> gradroute.Router:
        return gradroute.Router(
            tenc=gradroute.Group(self.tenc, optimizer=self.opt_t, scheduler=self.sched_t, max_grad_norm=max_t),
            unet=gradroute.Group(self.unet, optimizer=self.opt_u, scheduler=self.sched_u, max_grad_norm=max_u),
            scaler=self.scaler,
            **kw,
        )

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for m in (self.tenc, self.unet) for p in m.parameters()]


def reference_step(ref: Setup, batch: tuple, max_t: float | None, max_u: float | None, inf_unet: bool = False):
    """One iteration written out as in PyTorch's AMP notes for two models, two losses, two optimizers.

    Each loss gets its own forward (so each backward frees its own graph), every backward runs before any
    optimizer steps, each optimizer is unscaled once, clipped, stepped; the scaler is updated once; a scheduler
    steps when its optimizer's gradients were finite (the optimizer really stepped), or when the optimizer skips
    on the device (fused: ``GradScaler.step`` hands it ``found_inf``; the host does not know, and the recipe
    steps the scheduler).
    """
    scaler = ref.scaler if ref.scaler is not None else torch.amp.GradScaler("cpu", enabled=False)
    tenc_params, unet_params = list(ref.tenc.parameters()), list(ref.unet.parameters())
    loss_tenc, _ = losses(ref.tenc, ref.unet, batch, ref.dtype)
    scaler.scale(loss_tenc).backward(inputs=tenc_params)
    _, loss_unet = losses(ref.tenc, ref.unet, batch, ref.dtype, inf_unet=inf_unet)
    scaler.scale(loss_unet).backward(inputs=unet_params)
    scale = scaler.get_scale() if scaler.is_enabled() else None
    scaler.unscale_(ref.opt_t)
    scaler.unscale_(ref.opt_u)
    norms = []
    for params, max_norm in ((tenc_params, max_t), (unet_params, max_u)):
        if max_norm is None:
            norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))))
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
    lrs = [ref.opt_t.param_groups[0]["lr"], ref.opt_u.param_groups[0]["lr"]]
    scaler.step(ref.opt_t)
    scaler.step(ref.opt_u)
    scaler.update()
    for sched, opt, norm in ((ref.sched_t, ref.opt_t, norms[0]), (ref.sched_u, ref.opt_u, norms[1])):
        if math.isfinite(norm) or getattr(opt, "_step_supports_amp_scaling", False):
            sched.step()
    ref.opt_t.zero_grad(set_to_none=True)
    ref.opt_u.zero_grad(set_to_none=True)
    return {
        "loss": [loss_tenc.item(), loss_unet.item()],
        "grad_norm": norms,
        "lr": lrs,
        "scale": scale,
    }


def assert_params(actual: list[torch.Tensor], expected: list[torch.Tensor], rtol: float, atol: float) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol)


def trained_once(precision: str = "fp16-scaler") -> tuple[Setup, gradroute.Router]:
    s = Setup("adamw-foreach", precision)
    router = s.router(max_t=1.0)
    router.backward(loss_dict(s.tenc, s.unet, make_batches(1)[0], s.dtype))
    router.step()
    return s, router


def backward_again(s: Setup, router: gradroute.Router, seed: int = 2) -> None:
    router.backward(loss_dict(s.tenc, s.unet, make_batches(1, seed=seed)[0], s.dtype))
