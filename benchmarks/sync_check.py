"""The seed's training step under ``torch.cuda.set_sync_debug_mode("error")``: no host sync, as in the hand loop.

    python benchmarks/sync_check.py [--steps 5] [--dtype fp16|bf16]

Two chained networks, two fused AdamW, warmup+power schedules, clipping at 1.0 and one GradScaler (fp16); the
hand-written loop of torch's AMP notes runs first under the same mode as the control, then ``router.backward``
and ``router.step()``. Any synchronizing call raises; the script prints ``OK`` per loop, or the error. Needs
CUDA (GPU runs: benchmarks/gpu.sh).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch
from torch import nn

import gradroute
from gradroute.schedules import warmup_power


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def build(dtype: torch.dtype) -> tuple[nn.Module, nn.Module, list, list, torch.amp.GradScaler | None]:
    torch.manual_seed(0)
    tenc = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)).cuda()
    unet = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1)).cuda()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for m in (tenc, unet)]
    scheds = [warmup_power(o, warmup_steps=3, exponent=2.0, total_steps=100) for o in opts]
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
    return tenc, unet, opts, scheds, scaler


def losses(tenc: nn.Module, unet: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The boundary and the two losses of one forward."""
    x = torch.randn(64, 256, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        h = tenc(x)
        loss = (unet(h).float() - 1).pow(2)
    return h, loss.mean(), loss[:32].mean()


def hand(steps: int, dtype: torch.dtype) -> None:
    """The hand cut at the boundary, then torch's AMP recipe for several optimizers."""
    tenc, unet, opts, scheds, scaler = build(dtype)
    for k in range(steps + 2):
        with no_sync() if k >= 2 else contextlib.nullcontext():
            h, loss_tenc, loss_unet = losses(tenc, unet, dtype)
            if scaler is not None:
                loss_tenc, loss_unet = scaler.scale(loss_tenc), scaler.scale(loss_unet)
            (g_h,) = torch.autograd.grad(loss_tenc, h, retain_graph=True)
            loss_unet.backward(inputs=list(unet.parameters()))
            h.backward(g_h, inputs=list(tenc.parameters()))
            for opt, m in zip(opts, (tenc, unet)):
                if scaler is not None:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            for opt in opts:
                if scaler is not None:
                    scaler.step(opt)
                else:
                    opt.step()
            if scaler is not None:
                scaler.update()
            for sched, opt in zip(scheds, opts):
                sched.step()
                opt.zero_grad(set_to_none=True)


def routed(steps: int, dtype: torch.dtype) -> None:
    tenc, unet, opts, scheds, scaler = build(dtype)
    router = gradroute.Router(
        tenc=gradroute.Group(tenc, optimizer=opts[0], scheduler=scheds[0], max_grad_norm=1.0),
        unet=gradroute.Group(unet, optimizer=opts[1], scheduler=scheds[1], max_grad_norm=1.0),
        scaler=scaler,
    )
    k = 0
    while router.autotuning or k < 2:  # the measured choice times its trials (it synchronizes): not the step
        _, loss_tenc, loss_unet = losses(tenc, unet, dtype)
        router.backward(tenc=loss_tenc, unet=loss_unet)
        router.step()
        k += 1
    with no_sync():
        for _ in range(steps):
            _, loss_tenc, loss_unet = losses(tenc, unet, dtype)
            router.backward(tenc=loss_tenc, unet=loss_unet)
            router.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    args = p.parse_args()
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    failed = False
    for name, loop in (("hand-written loop", hand), ("router", routed)):
        try:
            loop(args.steps, dtype)
            print(f"{name}, {args.dtype}: OK (no host sync in {args.steps} steps)")
        except RuntimeError as e:
            failed = True
            print(f"{name}, {args.dtype}: FAILED: {e}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
